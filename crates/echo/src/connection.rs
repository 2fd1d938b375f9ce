//! HTTP/1.1 framing for a single client connection.
//!
//! [`Connection`] turns a byte stream into [`Request`]s and writes [`Response`]s
//! back. Request bodies are read and discarded: the echo server only reports
//! how long they were, so there is no reason to keep them in memory. A
//! connection made with `capture` set also hashes each body and keeps its
//! first [`MAX_KEPT_BODY`] bytes, for the request log.

use std::io;
use std::time::Duration;

use sha2::{Digest, Sha256};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// Upper bound for a request head; anything larger is answered with 400
/// instead of letting a broken client grow the buffer forever.
const MAX_HEAD_BYTES: usize = 64 * 1024;

/// Upper bound for one line of chunked framing (chunk size or trailer).
const MAX_LINE_BYTES: usize = 8 * 1024;

/// Number of header fields accepted in a request head.
const MAX_HEADERS: usize = 100;

/// How many bytes to ask the socket for at a time.
const READ_CHUNK: usize = 8 * 1024;

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
    /// The request-target exactly as it appeared on the request line.
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

    fn expects_continue(&self) -> bool {
        self.header("expect")
            .is_some_and(|v| v.trim().eq_ignore_ascii_case("100-continue"))
    }

    fn body_framing(&self) -> Result<BodyFraming, ReadError> {
        let mut codings = Vec::new();
        let mut length: Option<u64> = None;
        for (name, value) in &self.headers {
            match name.as_str() {
                "transfer-encoding" => codings.extend(
                    value
                        .split(',')
                        .map(str::trim)
                        .filter(|coding| !coding.is_empty()),
                ),
                "content-length" => {
                    let parsed = value
                        .trim()
                        .parse::<u64>()
                        .map_err(|_| ReadError::Malformed("invalid content-length"))?;
                    // Disagreeing lengths are the classic request smuggling
                    // vector, so refuse them rather than pick one.
                    if length.is_some_and(|previous| previous != parsed) {
                        return Err(ReadError::Malformed("conflicting content-length"));
                    }
                    length = Some(parsed);
                }
                _ => {}
            }
        }

        // Transfer-Encoding takes precedence over Content-Length (RFC 9112 §6.3).
        match codings.as_slice() {
            [] => Ok(length.map_or(BodyFraming::Empty, BodyFraming::Length)),
            [coding] if coding.eq_ignore_ascii_case("chunked") => Ok(BodyFraming::Chunked),
            _ => Err(ReadError::Malformed("unsupported transfer-encoding")),
        }
    }
}

/// How the body of a request is delimited.
enum BodyFraming {
    Empty,
    Length(u64),
    Chunked,
}

/// Why no request could be read.
#[derive(Debug)]
pub(crate) enum ReadError {
    /// The socket failed or the peer went away mid-request. The cause is
    /// dropped because nothing can be answered on such a connection anyway.
    Disconnected,
    /// The peer sent something we cannot frame; the connection is unusable
    /// afterwards, so the caller should answer 400 and hang up.
    Malformed(&'static str),
}

impl From<io::Error> for ReadError {
    fn from(_: io::Error) -> Self {
        ReadError::Disconnected
    }
}

/// A response ready to be written.
#[derive(Debug)]
pub(crate) struct Response {
    pub(crate) status: u16,
    /// Extra header fields; framing headers are added by [`Connection::write_response`].
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

    /// Whether this status code forbids a message body (RFC 9110 §6.4.1).
    fn is_bodiless(&self) -> bool {
        matches!(self.status, 204 | 304)
    }
}

/// One client connection with its read buffer.
///
/// The buffer may hold bytes beyond the current request; they belong to the
/// next (pipelined) request and are kept for the next [`Connection::read_request`].
pub(crate) struct Connection {
    stream: TcpStream,
    buffer: Vec<u8>,
    /// Whether request bodies are hashed and their beginnings kept.
    capture: bool,
}

impl Connection {
    pub(crate) fn new(stream: TcpStream, capture: bool) -> Connection {
        Connection {
            stream,
            buffer: Vec::with_capacity(READ_CHUNK),
            capture,
        }
    }

    /// Reads the next complete request, head and body.
    ///
    /// Returns `Ok(None)` when the peer closed the connection between requests,
    /// which is the normal end of a keep-alive connection.
    pub(crate) async fn read_request(&mut self) -> Result<Option<Request>, ReadError> {
        let (mut request, head_len) = loop {
            if let Some(parsed) = parse_head(&self.buffer)? {
                break parsed;
            }
            if self.buffer.len() > MAX_HEAD_BYTES {
                return Err(ReadError::Malformed("request head too large"));
            }
            if self.fill().await? == 0 {
                if self.buffer.is_empty() {
                    return Ok(None);
                }
                return Err(unexpected_eof().into());
            }
        };
        self.buffer.drain(..head_len);

        let framing = request.body_framing()?;
        if request.expects_continue() && !matches!(framing, BodyFraming::Empty) {
            // Clients such as curl otherwise wait a second before sending the body.
            self.stream
                .write_all(b"HTTP/1.1 100 Continue\r\n\r\n")
                .await?;
        }
        let mut sink = self.capture.then(BodySink::new);
        request.body_len = match framing {
            BodyFraming::Empty => 0,
            BodyFraming::Length(len) => {
                self.skip_exact(len, &mut sink).await?;
                len
            }
            BodyFraming::Chunked => self.skip_chunked(&mut sink).await?,
        };
        request.body = sink.map(BodySink::finish);
        Ok(Some(request))
    }

    /// Writes `response`, omitting the body when `head_only` (the answer to a
    /// HEAD request). Framing headers are added here so handlers cannot get
    /// them wrong.
    pub(crate) async fn write_response(
        &mut self,
        response: &Response,
        head_only: bool,
    ) -> io::Result<()> {
        let mut head = format!(
            "HTTP/1.1 {} {}\r\n",
            response.status,
            reason_phrase(response.status)
        );
        for (name, value) in &response.headers {
            head.push_str(&format!("{name}: {value}\r\n"));
        }
        // 204 must not carry Content-Length, and for 304 it would describe a
        // representation we do not have; every other response gets one.
        if !response.is_bodiless() {
            head.push_str(&format!("content-length: {}\r\n", response.body.len()));
        }
        if response.close {
            head.push_str("connection: close\r\n");
        }
        head.push_str("\r\n");

        let mut out = head.into_bytes();
        if !head_only && !response.is_bodiless() {
            out.extend_from_slice(&response.body);
        }
        self.stream.write_all(&out).await?;
        self.stream.flush().await
    }

    /// Ends the connection politely: send FIN, then drain input for a short
    /// while so that the kernel does not answer unread data with a reset.
    pub(crate) async fn close(mut self) {
        if self.stream.shutdown().await.is_err() {
            return;
        }
        let drain = async {
            let mut sink = [0u8; 1024];
            while matches!(self.stream.read(&mut sink).await, Ok(n) if n > 0) {}
        };
        let _ = tokio::time::timeout(LINGER, drain).await;
    }

    /// Reads more bytes from the socket into the buffer; 0 means end of stream.
    async fn fill(&mut self) -> io::Result<usize> {
        self.buffer.reserve(READ_CHUNK);
        self.stream.read_buf(&mut self.buffer).await
    }

    /// Like [`Connection::fill`], but end of stream is an error because we are
    /// in the middle of a request.
    async fn fill_required(&mut self) -> io::Result<()> {
        match self.fill().await? {
            0 => Err(unexpected_eof()),
            _ => Ok(()),
        }
    }

    /// Consumes exactly `len` body bytes, passing them to `sink` if there is one.
    async fn skip_exact(&mut self, mut len: u64, sink: &mut Option<BodySink>) -> io::Result<()> {
        loop {
            let available = self
                .buffer
                .len()
                .min(usize::try_from(len).unwrap_or(usize::MAX));
            if let Some(sink) = sink {
                sink.take(&self.buffer[..available]);
            }
            self.buffer.drain(..available);
            len -= available as u64;
            if len == 0 {
                return Ok(());
            }
            self.fill_required().await?;
        }
    }

    /// Consumes a chunked body including trailers and returns its decoded length.
    async fn skip_chunked(&mut self, sink: &mut Option<BodySink>) -> Result<u64, ReadError> {
        let mut total: u64 = 0;
        loop {
            let size = self.read_chunk_size().await?;
            if size == 0 {
                self.skip_trailers().await?;
                return Ok(total);
            }
            self.skip_exact(size, sink).await?;
            if self.read_line().await? != 0 {
                return Err(ReadError::Malformed("chunk data not followed by CRLF"));
            }
            total = total.saturating_add(size);
        }
    }

    async fn read_chunk_size(&mut self) -> Result<u64, ReadError> {
        loop {
            match httparse::parse_chunk_size(&self.buffer) {
                Ok(httparse::Status::Complete((used, size))) => {
                    self.buffer.drain(..used);
                    return Ok(size);
                }
                Ok(httparse::Status::Partial) if self.buffer.len() > MAX_LINE_BYTES => {
                    return Err(ReadError::Malformed("chunk size line too long"));
                }
                Ok(httparse::Status::Partial) => self.fill_required().await?,
                Err(_) => return Err(ReadError::Malformed("invalid chunk size")),
            }
        }
    }

    /// Trailer fields are not interesting to us; skip lines up to the empty one.
    async fn skip_trailers(&mut self) -> Result<(), ReadError> {
        let mut trailer_bytes = 0;
        loop {
            let len = self.read_line().await?;
            if len == 0 {
                return Ok(());
            }
            trailer_bytes += len;
            if trailer_bytes > MAX_HEAD_BYTES {
                return Err(ReadError::Malformed("trailers too large"));
            }
        }
    }

    /// Consumes one line and returns its length without the line ending.
    async fn read_line(&mut self) -> Result<usize, ReadError> {
        loop {
            if let Some(newline) = self.buffer.iter().position(|&b| b == b'\n') {
                let line_len = if newline > 0 && self.buffer[newline - 1] == b'\r' {
                    newline - 1
                } else {
                    newline
                };
                self.buffer.drain(..=newline);
                return Ok(line_len);
            }
            if self.buffer.len() > MAX_LINE_BYTES {
                return Err(ReadError::Malformed("line too long"));
            }
            self.fill_required().await?;
        }
    }
}

/// Parses a request head from the start of `buffer`. Returns the request
/// (without body) and the length of the head, or `None` if more bytes are needed.
fn parse_head(buffer: &[u8]) -> Result<Option<(Request, usize)>, ReadError> {
    let mut headers = [httparse::EMPTY_HEADER; MAX_HEADERS];
    let mut parsed = httparse::Request::new(&mut headers);
    let head_len = match parsed.parse(buffer) {
        Ok(httparse::Status::Complete(len)) => len,
        Ok(httparse::Status::Partial) => return Ok(None),
        Err(httparse::Error::TooManyHeaders) => {
            return Err(ReadError::Malformed("too many header fields"))
        }
        Err(_) => return Err(ReadError::Malformed("invalid request head")),
    };

    // A complete parse always fills method, path and version.
    let request = Request {
        method: parsed.method.unwrap_or_default().to_string(),
        target: parsed.path.unwrap_or_default().to_string(),
        minor_version: parsed.version.unwrap_or(1),
        headers: parsed
            .headers
            .iter()
            .map(|h| {
                (
                    h.name.to_ascii_lowercase(),
                    String::from_utf8_lossy(h.value).into_owned(),
                )
            })
            .collect(),
        body_len: 0,
        body: None,
    };
    Ok(Some((request, head_len)))
}

fn unexpected_eof() -> io::Error {
    io::Error::new(
        io::ErrorKind::UnexpectedEof,
        "connection closed mid-request",
    )
}

/// The canonical reason phrase, or a neutral one for codes without a common name.
fn reason_phrase(status: u16) -> &'static str {
    match status {
        200 => "OK",
        201 => "Created",
        202 => "Accepted",
        204 => "No Content",
        206 => "Partial Content",
        301 => "Moved Permanently",
        302 => "Found",
        303 => "See Other",
        304 => "Not Modified",
        307 => "Temporary Redirect",
        308 => "Permanent Redirect",
        400 => "Bad Request",
        401 => "Unauthorized",
        403 => "Forbidden",
        404 => "Not Found",
        405 => "Method Not Allowed",
        408 => "Request Timeout",
        409 => "Conflict",
        413 => "Content Too Large",
        429 => "Too Many Requests",
        500 => "Internal Server Error",
        501 => "Not Implemented",
        502 => "Bad Gateway",
        503 => "Service Unavailable",
        504 => "Gateway Timeout",
        _ => "Status",
    }
}
