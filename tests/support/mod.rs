//! Shared harness for the end-to-end tests.
//!
//! Every test file does `mod support;` and drives a real `sluice` process
//! ([`Gateway`]) in front of real [`sluice_echo::EchoServer`] backends, talking
//! to both over TCP with the small keep-alive capable [`HttpClient`].
//!
//! Nothing here may hang a test: process start-up is bounded, and every
//! network read or write gives up after [`IO_TIMEOUT`].

// Each test binary compiles its own copy of this module and uses only part of it.
#![allow(dead_code)]

pub mod config;
pub mod store;
pub mod tinyproxy;
pub mod tls;

#[allow(unused_imports)]
pub use config::{Config, Cooldown, Egress, HealthCheck, KeyMember, Passive, Quota, Route, State};
#[allow(unused_imports)]
pub use store::{Backend, Store};

use std::fs;
use std::future::Future;
use std::io::{self, Read, Write};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use sluice_echo::EchoServer;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// Upper bound for any single network operation of the harness. Generous: it only bounds a
/// hang, and a request that waits at a quota in the gateway for a window or two must get its
/// answer however slow the machine.
pub const IO_TIMEOUT: Duration = Duration::from_secs(30);

/// How long [`Gateway::start`] waits for the admin endpoint to become healthy: a process start
/// on a loaded 2-core machine can take seconds.
pub const STARTUP_TIMEOUT: Duration = Duration::from_secs(30);

/// Interval of the polling helpers.
const POLL_INTERVAL: Duration = Duration::from_millis(50);

/// A TCP port on 127.0.0.1 for a server the test starts later (the gateway, or a member that
/// must be named before it runs): free, and never handed to anything else in this process
/// ([`sluice_testkit::free_port`] says why that needs more than binding port 0).
pub fn free_port() -> u16 {
    sluice_testkit::free_port()
}

/// Like [`free_port`], `N` distinct ports.
pub fn free_ports<const N: usize>() -> [u16; N] {
    std::array::from_fn(|_| free_port())
}

/// `http://<addr>`: a member URL for a backend.
pub fn url(addr: SocketAddr) -> String {
    format!("http://{addr}")
}

/// A member URL where nothing listens, and nothing will while the test runs
/// ([`sluice_testkit::refused_port`]).
pub fn dead_url() -> String {
    format!("http://127.0.0.1:{}", refused_port())
}

/// A port of 127.0.0.1 that refuses connections while the test runs.
pub fn refused_port() -> u16 {
    sluice_testkit::refused_port()
}

/// Starts one echo backend per name, each on a free port of 127.0.0.1.
pub async fn start_backends(names: &[&str]) -> Vec<EchoServer> {
    let mut backends = Vec::with_capacity(names.len());
    for name in names {
        let server = EchoServer::start(name, SocketAddr::from(([127, 0, 0, 1], 0)))
            .await
            .unwrap_or_else(|err| panic!("cannot start echo backend {name}: {err}"));
        backends.push(server);
    }
    backends
}

/// Polls `condition` every 50 ms until it holds or `timeout` elapses.
/// Returns whether it held; the condition is always checked at least once.
pub async fn wait_until(timeout: Duration, mut condition: impl FnMut() -> bool) -> bool {
    wait_until_async(timeout, || std::future::ready(condition())).await
}

/// Like [`wait_until`], for conditions that need to await (e.g. an HTTP request).
pub async fn wait_until_async<F, Fut>(timeout: Duration, mut condition: F) -> bool
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        if condition().await {
            return true;
        }
        if tokio::time::Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(POLL_INTERVAL).await;
    }
}

// ---------------------------------------------------------------------------
// The gateway process
// ---------------------------------------------------------------------------

/// A directory under the system temp dir that is removed on drop: a [`tempfile::TempDir`]
/// whose name starts with a prefix that says which test made it.
#[derive(Debug)]
pub struct TempDir(tempfile::TempDir);

impl TempDir {
    /// Creates a fresh directory whose name starts with `prefix`.
    pub fn new(prefix: &str) -> TempDir {
        tempfile::Builder::new()
            .prefix(&format!("{prefix}-"))
            .tempdir()
            .map(TempDir)
            .unwrap_or_else(|err| panic!("cannot create a temp dir {prefix}-*: {err}"))
    }

    /// The directory itself.
    pub fn path(&self) -> &Path {
        self.0.path()
    }
}

/// Path of the gateway binary built by cargo for this test target, or `$SLUICE_TEST_BINARY`
/// (to run a test against another build, e.g. to check that it fails before a fix).
pub fn sluice_binary() -> PathBuf {
    std::env::var_os("SLUICE_TEST_BINARY")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_BIN_EXE_sluice")))
}

/// A running `sluice run -c <file>` process.
///
/// Its stderr (the JSON log) is captured in a file next to the config, see
/// [`Gateway::logs`]. Dropping the handle kills the process if it is still
/// running and removes the directory; if the test is panicking, the logs are
/// printed first so that the failure can be understood.
#[derive(Debug)]
pub struct Gateway {
    child: Child,
    dir: TempDir,
    config_path: PathBuf,
    log_path: PathBuf,
    proxy_addr: Option<SocketAddr>,
    admin_addr: SocketAddr,
}

impl Gateway {
    /// Starts the gateway with `config_yaml` and waits until its admin
    /// `/healthz` answers 200.
    ///
    /// The addresses are read from the YAML (the first address under the
    /// top-level `listen` key, or `proxy.listen`, and `admin.listen`). Blocks the calling thread
    /// for up to [`STARTUP_TIMEOUT`], then panics with the logs.
    pub fn start(config_yaml: &str) -> Gateway {
        let admin_addr = yaml_addr(config_yaml, &["admin", "listen"])
            .expect("config has no admin.listen socket address");
        let proxy_addr = yaml_addr(config_yaml, &["listen"])
            .or_else(|| yaml_addr(config_yaml, &["proxy", "listen"]));
        Gateway::launch(config_yaml, proxy_addr, admin_addr, &[])
    }

    /// Replaces `{PROXY}` and `{ADMIN}` in `template` with `127.0.0.1:<free
    /// port>` and starts the gateway like [`Gateway::start`].
    pub fn start_with_ports(template: &str) -> Gateway {
        Gateway::start_with_ports_and_env(template, &[])
    }

    /// Like [`Gateway::start_with_ports`], with extra environment variables for the process.
    pub fn start_with_ports_and_env(template: &str, env: &[(&str, &str)]) -> Gateway {
        let [proxy_port, admin_port] = free_ports::<2>();
        let proxy_addr = SocketAddr::from(([127, 0, 0, 1], proxy_port));
        let admin_addr = SocketAddr::from(([127, 0, 0, 1], admin_port));
        let config = template
            .replace("{PROXY}", &proxy_addr.to_string())
            .replace("{ADMIN}", &admin_addr.to_string());
        Gateway::launch(&config, Some(proxy_addr), admin_addr, env)
    }

    fn launch(
        config_yaml: &str,
        proxy_addr: Option<SocketAddr>,
        admin_addr: SocketAddr,
        env: &[(&str, &str)],
    ) -> Gateway {
        let dir = TempDir::new("sluice-e2e");
        let config_path = dir.path().join("sluice.yaml");
        let log_path = dir.path().join("stderr.log");
        fs::write(&config_path, config_yaml).expect("write config");
        let stderr = fs::File::create(&log_path).expect("create log file");
        let stdout = fs::File::create(dir.path().join("stdout.log")).expect("create stdout file");

        let child = Command::new(sluice_binary())
            .arg("run")
            .arg("-c")
            .arg(&config_path)
            .envs(env.iter().copied())
            .stdin(Stdio::null())
            .stdout(stdout)
            .stderr(stderr)
            .spawn()
            .unwrap_or_else(|err| panic!("cannot spawn {}: {err}", sluice_binary().display()));

        let mut gateway = Gateway {
            child,
            dir,
            config_path,
            log_path,
            proxy_addr,
            admin_addr,
        };
        gateway.wait_ready();
        gateway
    }

    fn wait_ready(&mut self) {
        let deadline = Instant::now() + STARTUP_TIMEOUT;
        loop {
            if let Some(status) = self.child.try_wait().expect("try_wait") {
                panic!(
                    "gateway exited during start-up with {status}\n--- logs ---\n{}",
                    self.logs()
                );
            }
            // The admin API and the proxy listeners are separate Pingora services that bind in
            // parallel: ready means both answer (a bare connect, closed at once, which sluice
            // does not count as a request or an idle connection).
            let proxy_up = self.proxy_addr.is_none_or(|addr| {
                std::net::TcpStream::connect_timeout(&addr, Duration::from_secs(1)).is_ok()
            });
            if blocking_healthz(self.admin_addr) && proxy_up {
                return;
            }
            if Instant::now() >= deadline {
                panic!(
                    "gateway admin {} not healthy (or proxy not listening) after {STARTUP_TIMEOUT:?}\n--- logs ---\n{}",
                    self.admin_addr,
                    self.logs()
                );
            }
            std::thread::sleep(POLL_INTERVAL);
        }
    }

    /// The proxy listener address.
    ///
    /// Panics if it was not substituted by [`Gateway::start_with_ports`] and
    /// could not be found in the YAML either.
    pub fn proxy_addr(&self) -> SocketAddr {
        self.proxy_addr
            .expect("proxy address unknown: no socket address under `listen` in the config")
    }

    /// The admin API address.
    pub fn admin_addr(&self) -> SocketAddr {
        self.admin_addr
    }

    /// Process id of the gateway.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// The config file the gateway was started with.
    pub fn config_path(&self) -> PathBuf {
        self.config_path.clone()
    }

    /// The temp directory holding config and logs.
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// Replaces the config file, e.g. before a reload signal.
    ///
    /// Written to a sibling file and renamed into place, so the gateway can
    /// never read a half-written config.
    pub fn write_config(&self, config_yaml: &str) {
        let staging = self.dir.path().join("sluice.yaml.new");
        fs::write(&staging, config_yaml).expect("write staging config");
        fs::rename(&staging, &self.config_path).expect("rename config into place");
    }

    /// Like [`Gateway::write_config`] with `{PROXY}` and `{ADMIN}` replaced by
    /// the addresses this gateway was started with.
    pub fn write_config_template(&self, template: &str) {
        let config = template
            .replace("{PROXY}", &self.proxy_addr().to_string())
            .replace("{ADMIN}", &self.admin_addr.to_string());
        self.write_config(&config);
    }

    /// Everything the gateway wrote to stderr so far.
    pub fn logs(&self) -> String {
        fs::read(&self.log_path)
            .map(|bytes| String::from_utf8_lossy(&bytes).into_owned())
            .unwrap_or_default()
    }

    /// The log lines that parse as JSON objects, in order.
    pub fn log_json(&self) -> Vec<serde_json::Value> {
        self.logs()
            .lines()
            .filter_map(|line| serde_json::from_str::<serde_json::Value>(line).ok())
            .filter(serde_json::Value::is_object)
            .collect()
    }

    /// Waits until the logs contain `needle`.
    pub async fn wait_for_log(&self, needle: &str, timeout: Duration) -> bool {
        wait_until(timeout, || self.logs().contains(needle)).await
    }

    /// Sends SIGTERM.
    pub fn sigterm(&self) {
        self.signal("TERM");
    }

    /// Sends the signal `name` (as understood by `kill`, e.g. `"HUP"`,
    /// `"INT"`, `"QUIT"`) to the gateway.
    pub fn signal(&self, name: &str) {
        let status = Command::new("kill")
            .arg(format!("-{name}"))
            .arg(self.pid().to_string())
            .status()
            .expect("run kill");
        assert!(
            status.success(),
            "kill -{name} {} failed: {status}",
            self.pid()
        );
    }

    /// Whether the process is still running.
    pub fn is_running(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }

    /// Waits up to `timeout` for the process to exit and returns its status,
    /// or `None` if it is still running. Blocks the calling thread; prefer
    /// [`Gateway::wait_exit_async`] when the test still needs the runtime
    /// (e.g. backends or clients running on it) meanwhile.
    pub fn wait_exit(&mut self, timeout: Duration) -> Option<ExitStatus> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(status) = self.child.try_wait().expect("try_wait") {
                return Some(status);
            }
            if Instant::now() >= deadline {
                return None;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Like [`Gateway::wait_exit`], but yields to the tokio runtime while waiting.
    pub async fn wait_exit_async(&mut self, timeout: Duration) -> Option<ExitStatus> {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            if let Some(status) = self.child.try_wait().expect("try_wait") {
                return Some(status);
            }
            if tokio::time::Instant::now() >= deadline {
                return None;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// `GET path` on the admin API.
    pub async fn admin(&self, path: &str) -> Response {
        admin_get(self.admin_addr, path).await
    }

    /// `POST /reload` on the admin API, with the header a POST needs when no admin token is
    /// configured.
    pub async fn post_reload(&self) -> Response {
        request(
            self.admin_addr,
            "POST",
            "admin",
            "/reload",
            &[("X-Sluice-Admin", "1")],
            b"",
        )
        .await
    }

    /// The Prometheus text of the admin `/metrics` endpoint.
    pub async fn metrics(&self) -> String {
        let response = self.admin("/metrics").await;
        assert_eq!(response.status, 200, "GET /metrics: {}", response.text());
        response.text()
    }

    /// One value from `/metrics`, see [`metric_value`].
    pub async fn metric(&self, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
        metric_value(&self.metrics().await, name, labels)
    }

    /// The admin `/status` document.
    pub async fn status(&self) -> serde_json::Value {
        let response = self.admin("/status").await;
        assert_eq!(response.status, 200, "GET /status: {}", response.text());
        response.json()
    }
}

impl Drop for Gateway {
    fn drop(&mut self) {
        if matches!(self.child.try_wait(), Ok(None)) {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
        if std::thread::panicking() {
            eprintln!(
                "--- sluice logs ({}) ---\n{}--- end of sluice logs ---",
                self.config_path.display(),
                self.logs()
            );
        }
    }
}

/// One blocking probe of the admin `/healthz`; only used while the gateway
/// starts, where the caller may not be inside a runtime.
fn blocking_healthz(addr: SocketAddr) -> bool {
    let probe = || -> io::Result<bool> {
        let mut stream = std::net::TcpStream::connect_timeout(&addr, Duration::from_millis(500))?;
        stream.set_read_timeout(Some(Duration::from_secs(1)))?;
        stream.set_write_timeout(Some(Duration::from_secs(1)))?;
        stream.write_all(b"GET /healthz HTTP/1.1\r\nHost: admin\r\nConnection: close\r\n\r\n")?;
        // The status line is all we need; do not wait for the body or EOF.
        let mut received = Vec::new();
        let mut chunk = [0u8; 256];
        while !received.windows(2).any(|w| w == b"\r\n") {
            let n = stream.read(&mut chunk)?;
            if n == 0 {
                break;
            }
            received.extend_from_slice(&chunk[..n]);
        }
        let status_line = String::from_utf8_lossy(&received);
        Ok(status_line.split_whitespace().nth(1) == Some("200"))
    };
    probe().unwrap_or(false)
}

/// Finds the first socket address in the YAML value at `path` (nested
/// mapping keys), in an inline value such as `listen: 127.0.0.1:80` or
/// `listen: ["127.0.0.1:80"]` or in the indented block below the key.
///
/// A line scan, not a YAML parser: good enough for the configs the tests write.
fn yaml_addr(yaml: &str, path: &[&str]) -> Option<SocketAddr> {
    let lines: Vec<&str> = yaml
        .lines()
        .map(|line| line.split(" #").next().unwrap_or(line))
        .filter(|line| !line.trim().is_empty() && !line.trim_start().starts_with('#'))
        .collect();
    let indent = |line: &str| line.len() - line.trim_start().len();

    let mut block: &[&str] = &lines;
    let mut inline = "";
    for key in path {
        // Direct children of the block are the least indented lines in it.
        let child_indent = block.iter().map(|l| indent(l)).min()?;
        let position = block.iter().position(|line| {
            indent(line) == child_indent
                && line
                    .trim_start()
                    .strip_prefix(key)
                    .is_some_and(|rest| rest.starts_with(':'))
        })?;
        let line = block[position];
        inline = line.trim_start()[key.len() + 1..].trim();
        let rest = &block[position + 1..];
        // YAML lets a sequence sit at the same indentation as its key.
        let end = rest
            .iter()
            .position(|l| {
                indent(l) < indent(line)
                    || (indent(l) == indent(line) && !l.trim_start().starts_with('-'))
            })
            .unwrap_or(rest.len());
        block = &rest[..end];
    }

    std::iter::once(inline)
        .chain(block.iter().copied())
        .flat_map(|line| line.split(|c: char| c.is_whitespace() || "[],\"'".contains(c)))
        .find_map(|token| token.parse().ok())
}

// ---------------------------------------------------------------------------
// HTTP client
// ---------------------------------------------------------------------------

/// A response as read by [`HttpClient`].
#[derive(Debug, Clone)]
pub struct Response {
    /// The final status code (interim 1xx responses are skipped).
    pub status: u16,
    /// Header fields in arrival order, names lowercased.
    pub headers: Vec<(String, String)>,
    /// The body, de-chunked if it was sent chunked.
    pub body: Vec<u8>,
}

impl Response {
    /// The first value of header `name` (case-insensitive).
    pub fn header(&self, name: &str) -> Option<&str> {
        let name = name.to_ascii_lowercase();
        self.headers
            .iter()
            .find(|(n, _)| *n == name)
            .map(|(_, v)| v.as_str())
    }

    /// All values of header `name` (case-insensitive), in order.
    pub fn header_all(&self, name: &str) -> Vec<&str> {
        let name = name.to_ascii_lowercase();
        self.headers
            .iter()
            .filter(|(n, _)| *n == name)
            .map(|(_, v)| v.as_str())
            .collect()
    }

    /// The body as text (lossy).
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }

    /// The body parsed as JSON; panics with the body if it is not JSON.
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body).unwrap_or_else(|err| {
            panic!(
                "response body (status {}) is not JSON: {err}\n{}",
                self.status,
                self.text()
            )
        })
    }
}

/// Formats a request head for [`HttpClient::send`]: request line, `Host`,
/// the given headers and, if `body_len > 0`, a `Content-Length` (unless the
/// caller passed one or a `Transfer-Encoding`).
pub fn request_head(
    method: &str,
    host: &str,
    path: &str,
    headers: &[(&str, &str)],
    body_len: usize,
) -> String {
    let mut head = format!("{method} {path} HTTP/1.1\r\nHost: {host}\r\n");
    for (name, value) in headers {
        head.push_str(&format!("{name}: {value}\r\n"));
    }
    let framed = headers.iter().any(|(name, _)| {
        name.eq_ignore_ascii_case("content-length")
            || name.eq_ignore_ascii_case("transfer-encoding")
    });
    if body_len > 0 && !framed {
        head.push_str(&format!("Content-Length: {body_len}\r\n"));
    }
    head.push_str("\r\n");
    head
}

/// A minimal HTTP/1.1 client on one TCP connection, reusable for several
/// requests (keep-alive). The caller forms the requests; the client only
/// frames the responses.
#[derive(Debug)]
pub struct HttpClient {
    stream: TcpStream,
    /// Bytes received but not yet consumed.
    buffer: Vec<u8>,
}

impl HttpClient {
    /// Opens a connection to `addr`.
    pub async fn connect(addr: SocketAddr) -> io::Result<HttpClient> {
        let stream = with_timeout(TcpStream::connect(addr)).await?;
        stream.set_nodelay(true)?;
        Ok(HttpClient {
            stream,
            buffer: Vec::new(),
        })
    }

    /// Local address of the connection, to tell connections apart.
    pub fn local_addr(&self) -> io::Result<SocketAddr> {
        self.stream.local_addr()
    }

    /// Sends `request` (a complete head, see [`request_head`]) followed by
    /// `body`, and reads the response.
    pub async fn send(&mut self, request: &str, body: &[u8]) -> io::Result<Response> {
        let mut bytes = Vec::with_capacity(request.len() + body.len());
        bytes.extend_from_slice(request.as_bytes());
        bytes.extend_from_slice(body);
        self.write_raw(&bytes).await?;
        self.read_response(request.starts_with("HEAD ")).await
    }

    /// Convenience for [`HttpClient::send`] with [`request_head`].
    pub async fn request(
        &mut self,
        method: &str,
        host: &str,
        path: &str,
        headers: &[(&str, &str)],
        body: &[u8],
    ) -> io::Result<Response> {
        let head = request_head(method, host, path, headers, body.len());
        self.send(&head, body).await
    }

    /// Writes raw bytes without reading anything, for tests that need to
    /// split or pipeline requests themselves.
    pub async fn write_raw(&mut self, bytes: &[u8]) -> io::Result<()> {
        with_timeout(self.stream.write_all(bytes)).await
    }

    /// Reads exactly `n` raw bytes (what was received but not framed yet first), for a
    /// connection that a CONNECT turned into a tunnel.
    pub async fn read_raw(&mut self, n: usize) -> io::Result<Vec<u8>> {
        while self.buffer.len() < n {
            self.fill_required().await?;
        }
        Ok(self.buffer.drain(..n).collect())
    }

    /// Reads the next response. Interim (1xx) responses are skipped.
    /// `head_only` must be set when answering a HEAD request, whose response
    /// announces a length but carries no body.
    pub async fn read_response(&mut self, head_only: bool) -> io::Result<Response> {
        loop {
            let (status, headers) = self.read_head().await?;
            if (100..200).contains(&status) {
                continue;
            }
            let has_header = |name: &str, wanted: &str| {
                headers
                    .iter()
                    .filter(|(n, _)| n == name)
                    .flat_map(|(_, v)| v.split(','))
                    .any(|token| token.trim().eq_ignore_ascii_case(wanted))
            };
            let content_length = headers
                .iter()
                .find(|(n, _)| n == "content-length")
                .map(|(_, v)| v.trim().parse::<usize>())
                .transpose()
                .map_err(|_| invalid_data("invalid content-length in response"))?;

            let body = if head_only || status == 204 || status == 304 {
                Vec::new()
            } else if has_header("transfer-encoding", "chunked") {
                self.read_chunked_body().await?
            } else if let Some(len) = content_length {
                self.take_exact(len).await?
            } else {
                self.read_to_eof().await?
            };
            return Ok(Response {
                status,
                headers,
                body,
            });
        }
    }

    /// Waits up to `timeout` for the peer to close the connection; true if
    /// it did (without sending anything more).
    pub async fn wait_closed(&mut self, timeout: Duration) -> bool {
        let mut chunk = [0u8; 512];
        matches!(
            tokio::time::timeout(timeout, self.stream.read(&mut chunk)).await,
            Ok(Ok(0)) | Ok(Err(_))
        )
    }

    async fn read_head(&mut self) -> io::Result<(u16, Vec<(String, String)>)> {
        loop {
            let mut slots = [httparse::EMPTY_HEADER; 128];
            let mut parsed = httparse::Response::new(&mut slots);
            match parsed.parse(&self.buffer) {
                Ok(httparse::Status::Complete(head_len)) => {
                    let status = parsed.code.unwrap_or_default();
                    let headers = parsed
                        .headers
                        .iter()
                        .map(|h| {
                            (
                                h.name.to_ascii_lowercase(),
                                String::from_utf8_lossy(h.value).into_owned(),
                            )
                        })
                        .collect();
                    self.buffer.drain(..head_len);
                    return Ok((status, headers));
                }
                Ok(httparse::Status::Partial) => self.fill_required().await?,
                Err(err) => return Err(invalid_data(&format!("invalid response head: {err}"))),
            }
        }
    }

    async fn read_chunked_body(&mut self) -> io::Result<Vec<u8>> {
        let mut body = Vec::new();
        loop {
            let size = loop {
                match httparse::parse_chunk_size(&self.buffer) {
                    Ok(httparse::Status::Complete((used, size))) => {
                        self.buffer.drain(..used);
                        break usize::try_from(size)
                            .map_err(|_| invalid_data("chunk too large"))?;
                    }
                    Ok(httparse::Status::Partial) => self.fill_required().await?,
                    Err(_) => return Err(invalid_data("invalid chunk size")),
                }
            };
            if size == 0 {
                // Trailer fields are of no interest; skip up to the empty line.
                while !self.take_line().await?.is_empty() {}
                return Ok(body);
            }
            body.extend_from_slice(&self.take_exact(size).await?);
            if !self.take_line().await?.is_empty() {
                return Err(invalid_data("chunk data not followed by CRLF"));
            }
        }
    }

    async fn take_exact(&mut self, len: usize) -> io::Result<Vec<u8>> {
        while self.buffer.len() < len {
            self.fill_required().await?;
        }
        Ok(self.buffer.drain(..len).collect())
    }

    /// Consumes one line and returns it without the line ending.
    async fn take_line(&mut self) -> io::Result<Vec<u8>> {
        loop {
            if let Some(newline) = self.buffer.iter().position(|&b| b == b'\n') {
                let mut line: Vec<u8> = self.buffer.drain(..=newline).collect();
                line.pop();
                if line.last() == Some(&b'\r') {
                    line.pop();
                }
                return Ok(line);
            }
            self.fill_required().await?;
        }
    }

    async fn read_to_eof(&mut self) -> io::Result<Vec<u8>> {
        while self.fill().await? > 0 {}
        Ok(std::mem::take(&mut self.buffer))
    }

    async fn fill(&mut self) -> io::Result<usize> {
        self.buffer.reserve(8 * 1024);
        with_timeout(self.stream.read_buf(&mut self.buffer)).await
    }

    async fn fill_required(&mut self) -> io::Result<()> {
        match self.fill().await? {
            0 => Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "connection closed before the response was complete",
            )),
            _ => Ok(()),
        }
    }
}

async fn with_timeout<T>(operation: impl Future<Output = io::Result<T>>) -> io::Result<T> {
    tokio::time::timeout(IO_TIMEOUT, operation)
        .await
        .unwrap_or_else(|_| {
            Err(io::Error::new(
                io::ErrorKind::TimedOut,
                format!("no progress within {IO_TIMEOUT:?}"),
            ))
        })
}

fn invalid_data(message: &str) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, message.to_string())
}

/// One request on a fresh connection with `Connection: close`; errors are
/// returned, e.g. for tests that expect a refused connection.
pub async fn try_request(
    addr: SocketAddr,
    method: &str,
    host: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &[u8],
) -> io::Result<Response> {
    let mut all_headers = headers.to_vec();
    if !headers
        .iter()
        .any(|(name, _)| name.eq_ignore_ascii_case("connection"))
    {
        all_headers.push(("Connection", "close"));
    }
    let mut client = HttpClient::connect(addr).await?;
    client.request(method, host, path, &all_headers, body).await
}

/// Like [`try_request`], panicking on any I/O error.
pub async fn request(
    addr: SocketAddr,
    method: &str,
    host: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &[u8],
) -> Response {
    try_request(addr, method, host, path, headers, body)
        .await
        .unwrap_or_else(|err| panic!("{method} http://{host}{path} via {addr} failed: {err}"))
}

/// `GET path` with `Host: host` on a fresh connection.
pub async fn get(addr: SocketAddr, host: &str, path: &str) -> Response {
    request(addr, "GET", host, path, &[], b"").await
}

/// `GET path` on the admin API.
pub async fn admin_get(addr: SocketAddr, path: &str) -> Response {
    get(addr, "admin", path).await
}

// ---------------------------------------------------------------------------
// Prometheus text
// ---------------------------------------------------------------------------

/// The value of the sample named `name` whose labels include all of
/// `labels` (in any order); values of several matching samples are summed.
/// `None` if no sample matches. Single-valued samples only: counters, gauges,
/// untyped, and a histogram's `_sum` and `_count` (the parser folds its
/// `_bucket` lines into one value).
pub fn metric_value(metrics_text: &str, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
    let scrape =
        prometheus_parse::Scrape::parse(metrics_text.lines().map(|l| Ok(l.to_string()))).ok()?;
    scrape
        .samples
        .iter()
        .filter(|s| s.metric == name && labels.iter().all(|(k, v)| s.labels.get(k) == Some(*v)))
        .filter_map(|s| match s.value {
            prometheus_parse::Value::Counter(v)
            | prometheus_parse::Value::Gauge(v)
            | prometheus_parse::Value::Untyped(v) => Some(v),
            _ => None,
        })
        .reduce(|a, b| a + b)
}

/// A member that accepts a connection, reads a request and hangs up without answering, as a
/// crashing server would: the request reached it, so nothing may replay it. Returns its
/// address and how many requests it received.
pub async fn start_hang_up_member() -> (SocketAddr, std::sync::Arc<AtomicU64>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let received = std::sync::Arc::new(AtomicU64::new(0));
    let counter = received.clone();
    tokio::spawn(async move {
        while let Ok((mut conn, _)) = listener.accept().await {
            let counter = counter.clone();
            tokio::spawn(async move {
                let mut buf = vec![0u8; 4096];
                if matches!(conn.read(&mut buf).await, Ok(n) if n > 0) {
                    counter.fetch_add(1, Ordering::SeqCst);
                }
                let _ = conn.shutdown().await;
            });
        }
    });
    (addr, received)
}

/// The CI venv's Python (requests, httpx, the openai SDK, Selenium), from `SLUICE_TEST_PYTHON`.
/// Unset: in CI (`CI=true`) a failure, elsewhere a skip that says so.
pub fn test_python() -> Option<String> {
    match std::env::var("SLUICE_TEST_PYTHON") {
        Ok(python) if !python.is_empty() => Some(python),
        _ if std::env::var("CI").is_ok_and(|v| v == "true") => {
            panic!("CI=true but SLUICE_TEST_PYTHON is unset: .ci/run makes the venv and sets it")
        }
        _ => {
            eprintln!(
                "SKIPPED: SLUICE_TEST_PYTHON is unset; run .ci/run (or scripts its README names) \
                 and point SLUICE_TEST_PYTHON at the venv's python"
            );
            None
        }
    }
}

/// Sends `CONNECT authority` through the gateway at `proxy` on a new connection and reads the
/// answer: its head only when `head_only` (a `200` opens the tunnel on the returned client, and
/// has no body), else head and body (a refusal's problem+json).
pub async fn open_tunnel(
    proxy: SocketAddr,
    authority: &str,
    head_only: bool,
) -> (HttpClient, Response) {
    let mut client = HttpClient::connect(proxy).await.unwrap();
    client
        .write_raw(format!("CONNECT {authority} HTTP/1.1\r\nHost: {authority}\r\n\r\n").as_bytes())
        .await
        .unwrap();
    let r = client.read_response(head_only).await.unwrap();
    (client, r)
}
