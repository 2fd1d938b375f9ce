//! One client connection, served by hyper's HTTP/1.1 server.
//!
//! hyper frames requests and responses (Content-Length, chunked bodies and trailers,
//! `Expect: 100-continue`, keep-alive, HTTP/1.0, pipelining); this module turns a request into
//! the [`Request`] the echo logic reads, and a [`Response`] back into hyper's. Request bodies
//! are read and discarded: the echo server only reports how long they were. A connection made
//! with `capture` set also hashes each body and keeps its first [`MAX_KEPT_BODY`] bytes, for
//! the request log.

use std::convert::Infallible;
use std::future::Future;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::header::{HeaderName, HeaderValue};
use hyper_util::rt::TokioIo;
use sha2::{Digest, Sha256};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// Upper bound for a request head; hyper answers a larger one with 431 and closes, instead of
/// letting a broken client grow the buffer forever.
const MAX_HEAD_BYTES: usize = 64 * 1024;

/// Number of header fields accepted in a request head.
const MAX_HEADERS: usize = 100;

/// How much of a captured body is kept; the hash covers all of it.
pub const MAX_KEPT_BODY: usize = 64 * 1024;

/// How long a closing connection keeps draining what the peer still sends.
/// Closing a socket with unread input makes the kernel send a reset, which
/// could destroy the response we just wrote before the peer has read it.
const LINGER: Duration = Duration::from_secs(1);

/// A request whose head has been parsed and whose body has been consumed.
#[derive(Debug)]
pub(crate) struct Request {
    pub(crate) method: String,
    /// The request-target as it appeared on the request line.
    pub(crate) target: String,
    /// The minor HTTP version: 0 for HTTP/1.0, 1 for HTTP/1.1.
    pub(crate) minor_version: u8,
    /// Header fields in arrival order, names lowercased.
    pub(crate) headers: Vec<(String, String)>,
    pub(crate) body_len: u64,
    /// The body's hash and first bytes, when the connection captures bodies.
    pub(crate) body: Option<CapturedBody>,
}

/// What a capturing connection keeps of a request body.
#[derive(Debug)]
pub(crate) struct CapturedBody {
    pub(crate) sha256: [u8; 32],
    /// The first [`MAX_KEPT_BODY`] bytes.
    pub(crate) kept: Vec<u8>,
}

/// Hashes a body as it streams past and keeps its beginning.
struct BodySink {
    hasher: Sha256,
    kept: Vec<u8>,
}

impl BodySink {
    fn new() -> BodySink {
        BodySink {
            hasher: Sha256::new(),
            kept: Vec::new(),
        }
    }

    fn take(&mut self, bytes: &[u8]) {
        self.hasher.update(bytes);
        let room = MAX_KEPT_BODY - self.kept.len();
        self.kept.extend_from_slice(&bytes[..room.min(bytes.len())]);
    }

    fn finish(self) -> CapturedBody {
        CapturedBody {
            sha256: self.hasher.finalize().into(),
            kept: self.kept,
        }
    }
}

impl Request {
    /// The head of `parts`, with no body yet.
    fn of(parts: &hyper::http::request::Parts) -> Request {
        Request {
            method: parts.method.to_string(),
            target: parts.uri.to_string(),
            minor_version: u8::from(parts.version != hyper::Version::HTTP_10),
            headers: parts
                .headers
                .iter()
                .map(|(name, value)| {
                    (
                        name.as_str().to_string(),
                        String::from_utf8_lossy(value.as_bytes()).into_owned(),
                    )
                })
                .collect(),
            body_len: 0,
            body: None,
        }
    }

    /// The first value of header `name` (which must be lowercase).
    pub(crate) fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }

    /// The target without its query string.
    pub(crate) fn path(&self) -> &str {
        self.target
            .split_once('?')
            .map_or(self.target.as_str(), |(path, _)| path)
    }

    /// Whether the client asked for the connection to end after this exchange.
    pub(crate) fn wants_close(&self) -> bool {
        if self.minor_version == 0 {
            !self.has_connection_token("keep-alive")
        } else {
            self.has_connection_token("close")
        }
    }

    fn has_connection_token(&self, token: &str) -> bool {
        self.headers
            .iter()
            .filter(|(name, _)| name == "connection")
            .flat_map(|(_, value)| value.split(','))
            .any(|t| t.trim().eq_ignore_ascii_case(token))
    }

    /// Refuses what hyper lets through but the echo server does not frame: a transfer coding
    /// other than `chunked` alone. hyper reads `gzip, chunked` as chunked; a server that
    /// cannot undo the gzip must not pretend it read the body.
    fn check_framing(&self) -> Result<(), &'static str> {
        let mut codings = self
            .headers
            .iter()
            .filter(|(name, _)| name == "transfer-encoding")
            .flat_map(|(_, value)| value.split(','))
            .map(str::trim)
            .filter(|coding| !coding.is_empty());
        match (codings.next(), codings.next()) {
            (None, _) => Ok(()),
            (Some(coding), None) if coding.eq_ignore_ascii_case("chunked") => Ok(()),
            _ => Err("unsupported transfer-encoding"),
        }
    }
}

/// A response ready to be written.
#[derive(Debug)]
pub(crate) struct Response {
    pub(crate) status: u16,
    /// Extra header fields; hyper adds the framing ones (`content-length`).
    pub(crate) headers: Vec<(&'static str, String)>,
    pub(crate) body: Vec<u8>,
    /// Whether the connection must end after this response whatever the client wants.
    pub(crate) close: bool,
}

impl Response {
    /// A response with the given content type that keeps the connection open.
    pub(crate) fn new(status: u16, content_type: &str, body: impl Into<Vec<u8>>) -> Response {
        Response {
            status,
            headers: vec![("content-type", content_type.to_string())],
            body: body.into(),
            close: false,
        }
    }

    /// hyper's response. A `connection: close` field makes hyper end the connection after it.
    fn into_hyper(self) -> hyper::Response<Full<Bytes>> {
        let mut response = hyper::Response::new(Full::new(Bytes::from(self.body)));
        *response.status_mut() =
            hyper::StatusCode::from_u16(self.status).unwrap_or(hyper::StatusCode::OK);
        if response.status().canonical_reason().is_none() {
            // hyper would write `<none>`; a neutral phrase reads better in a log.
            response
                .extensions_mut()
                .insert(hyper::ext::ReasonPhrase::from_static(b"Status"));
        }
        let headers = response.headers_mut();
        for (name, value) in self.headers {
            // Every value was checked when it was set (names, scripted fields) or came from a
            // request field hyper accepted; one that still fails is left out, not a panic.
            if let Ok(value) = HeaderValue::from_bytes(value.as_bytes()) {
                headers.append(HeaderName::from_static(name), value);
            }
        }
        if self.close {
            headers.insert(hyper::header::CONNECTION, HeaderValue::from_static("close"));
        }
        response
    }
}

/// Serves requests on `stream` until either side wants it closed, answering each with
/// `answer(Ok(request))`, or `answer(Err(reason))` for a request the server cannot frame,
/// after which the connection ends.
pub(crate) async fn serve<A, F>(stream: TcpStream, capture: bool, answer: A)
where
    A: Fn(Result<Request, &'static str>) -> F + Clone + Send + 'static,
    F: Future<Output = Response> + Send,
{
    // Small answers are written in one go; don't let Nagle hold them back.
    let _ = stream.set_nodelay(true);
    let service = hyper::service::service_fn(move |request: hyper::Request<Incoming>| {
        let answer = answer.clone();
        async move {
            let (parts, body) = request.into_parts();
            let mut request = Request::of(&parts);
            let request = read_body(&mut request, body, capture)
                .await
                .map(|()| request);
            let malformed = request.is_err();
            let mut response = answer(request).await;
            response.close |= malformed;
            Ok::<_, Infallible>(response.into_hyper())
        }
    });
    let connection = hyper::server::conn::http1::Builder::new()
        .max_buf_size(MAX_HEAD_BYTES)
        .max_headers(MAX_HEADERS)
        // An idle keep-alive connection stays open for as long as the client keeps it: a proxy
        // that picks a pooled connection must find it there.
        .header_read_timeout(None)
        // A client that shuts its write side after a request still gets the answer.
        .half_close(true)
        .serve_connection(TokioIo::new(stream), service)
        // The socket comes back when the exchange is over, to be closed with a linger below.
        .without_shutdown();
    if let Ok(parts) = connection.await {
        close(parts.io.into_inner()).await;
    }
}

/// Reads the body of `request` to its end: its length, and what a capturing connection keeps.
async fn read_body(
    request: &mut Request,
    mut body: Incoming,
    capture: bool,
) -> Result<(), &'static str> {
    request.check_framing()?;
    let mut sink = capture.then(BodySink::new);
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(|_| "invalid body")?;
        if let Some(data) = frame.data_ref() {
            request.body_len += data.len() as u64;
            if let Some(sink) = &mut sink {
                sink.take(data);
            }
        }
    }
    request.body = sink.map(BodySink::finish);
    Ok(())
}

/// Ends the connection politely: send FIN, then drain input for a short
/// while so that the kernel does not answer unread data with a reset.
async fn close(mut stream: TcpStream) {
    if stream.shutdown().await.is_err() {
        return;
    }
    let drain = async {
        let mut sink = [0u8; 1024];
        while matches!(stream.read(&mut sink).await, Ok(n) if n > 0) {}
    };
    let _ = tokio::time::timeout(LINGER, drain).await;
}
