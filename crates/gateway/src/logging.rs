//! Logs: one JSON object per line on stderr (access log and events), or text for humans.
//!
//! Lines go through a background writer so that a request never waits on a write to stderr.
//! Access lines, one per request, are first gathered into a batch that reaches the writer
//! in one piece (see [`Batch`]): no queue message, allocation or thread wake-up per request.
//! The batch's buffer itself goes to the writer, which hands it back once written, so a line
//! is copied once, into the batch.

use std::cell::{Cell, RefCell};
use std::collections::VecDeque;
use std::fmt::Write as _;
use std::io::Write as _;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Condvar, Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant, SystemTime};

use tracing_subscriber::fmt::MakeWriter;
use tracing_subscriber::EnvFilter;

/// Log line format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    /// One JSON object per line.
    Json,
    /// Human-readable text.
    Text,
}

/// Where access lines go: the batch in front of the background writer, and the format.
static ACCESS: OnceLock<(&'static Batch, LogFormat)> = OnceLock::new();

/// A batch is handed to the writer once it holds this many bytes (about a hundred lines)...
const BATCH_BYTES: usize = 32 * 1024;
/// ...or at the latest this long after its first line, by the batch's flusher thread.
const BATCH_DELAY: Duration = Duration::from_millis(20);
/// Batches waiting for stderr beyond this many (4 MiB) are dropped rather than held: a
/// stderr that does not drain must not grow the gateway's memory or make requests wait.
const MAX_QUEUED_BATCHES: usize = 128;
/// How long [`flush`] waits at exit for stderr to take what is queued.
const FLUSH_WAIT: Duration = Duration::from_secs(2);

/// `sluice_log_lines_dropped_total`: log lines (access lines and events) dropped because
/// stderr did not take them fast enough. One per process, as the log writer is; every
/// gateway's registry exports it (`Metrics::new`).
pub static LINES_DROPPED: std::sync::LazyLock<prometheus::IntCounter> = std::sync::LazyLock::new(
    || {
        prometheus::IntCounter::new(
            "sluice_log_lines_dropped_total",
            "Log lines (access lines and events) dropped because stderr did not take them fast enough.",
        )
        .expect("valid metric")
    },
);

/// Access lines waiting for the background writer.
///
/// Sending each line on its own cost a copy into a new `Vec`, a message on the writer's queue
/// and, whenever the writer thread had gone idle, a futex wake-up: per request. Lines now
/// gather here and go to the writer as one batch, handed over by whoever fills it, or by
/// the flusher thread [`BATCH_DELAY`] after the first line of a quiet moment, or by
/// [`flush`] at exit. The one lock is held only to append a finished line or to hand the
/// batch over. A tracing event (a warning, a reload) is appended under the same lock and
/// hands the batch over at once, so lines keep the order in which they were written and an
/// event is not held back.
struct Batch {
    writer: Writer,
    pending: Mutex<Pending>,
    /// Wakes the flusher when the first line of a batch arrives while it waits.
    arrived: Condvar,
}

struct Pending {
    bytes: Vec<u8>,
    /// The flusher waits for a first line (rather than sleeping out a delay).
    flusher_waiting: bool,
}

impl Batch {
    fn lock(&self) -> MutexGuard<'_, Pending> {
        self.pending.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn push(&self, line: &[u8]) {
        let mut p = self.lock();
        p.bytes.extend_from_slice(line);
        if p.bytes.len() >= BATCH_BYTES {
            self.hand_over(&mut p);
        } else if p.flusher_waiting {
            p.flusher_waiting = false;
            self.arrived.notify_one();
        }
    }

    /// A tracing event's line: written now, after the access lines before it.
    fn push_event(&self, line: &[u8]) {
        let mut p = self.lock();
        p.bytes.extend_from_slice(line);
        self.hand_over(&mut p);
    }

    /// Sends the batch to the writer; the caller holds the lock, which keeps the order.
    fn hand_over(&self, p: &mut Pending) {
        if !p.bytes.is_empty() {
            self.writer.send(&mut p.bytes);
        }
    }

    fn flush(&self) {
        self.hand_over(&mut self.lock());
    }

    /// The flusher thread: hands a batch over [`BATCH_DELAY`] after its first line.
    fn run_flusher(&self) {
        loop {
            {
                let mut p = self.lock();
                while p.bytes.is_empty() {
                    p.flusher_waiting = true;
                    p = self.arrived.wait(p).unwrap_or_else(|e| e.into_inner());
                }
                p.flusher_waiting = false;
            }
            std::thread::sleep(BATCH_DELAY);
            self.flush();
        }
    }
}

/// The background writer: a thread that writes whole batches to stderr.
///
/// A batch's buffer is moved to the writer and comes back empty, with its capacity, for a
/// later batch. tracing-appender's writer, used before, copied each batch into a new `Vec`
/// for its queue and then into its `BufWriter`: two copies of every access line.
struct Writer {
    queue: Mutex<Queue>,
    /// Wakes the writer thread when a batch arrives.
    wake: Condvar,
    /// Tells [`flush`] that everything queued was written.
    drained: Condvar,
}

#[derive(Default)]
struct Queue {
    full: VecDeque<Vec<u8>>,
    /// Written buffers, emptied, kept for the next batches.
    spare: Vec<Vec<u8>>,
    /// The writer thread holds a batch it has not finished writing.
    writing: bool,
}

impl Writer {
    fn lock(&self) -> MutexGuard<'_, Queue> {
        self.queue.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Queues the bytes of `batch` and leaves it empty (a spare buffer in its place).
    fn send(&self, batch: &mut Vec<u8>) {
        let mut q = self.lock();
        if q.full.len() >= MAX_QUEUED_BATCHES {
            // A full queue drops the batch rather than making a request wait; counted, since
            // a gap in the access log must not pass unnoticed.
            let lines = batch.iter().filter(|&&b| b == b'\n').count();
            LINES_DROPPED.inc_by(lines as u64);
            batch.clear();
            return;
        }
        // No spare (the writer is behind): an empty `Vec`, which grows as lines arrive, so
        // that a burst of events costs no allocation of a whole batch each.
        let fresh = q.spare.pop().unwrap_or_default();
        q.full.push_back(std::mem::replace(batch, fresh));
        self.wake.notify_one();
    }

    fn run(&self) {
        let mut stderr = std::io::stderr();
        let mut q = self.lock();
        loop {
            let Some(mut batch) = q.full.pop_front() else {
                q.writing = false;
                self.drained.notify_all();
                q = self.wake.wait(q).unwrap_or_else(|e| e.into_inner());
                continue;
            };
            q.writing = true;
            drop(q);
            // Nothing to do about a failed write to stderr; the batch is gone either way.
            let _ = stderr.write_all(&batch);
            batch.clear();
            q = self.lock();
            if q.spare.len() < 2 {
                q.spare.push(batch);
            }
        }
    }

    /// Waits, at most `limit`, until everything queued was written.
    fn wait_drained(&self, limit: Duration) {
        let deadline = Instant::now() + limit;
        let mut q = self.lock();
        while !q.full.is_empty() || q.writing {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return;
            }
            q = self
                .drained
                .wait_timeout(q, left)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }
}

/// The writer tracing's events go through, behind the access lines before them.
struct Ordered(&'static Batch);

impl<'a> MakeWriter<'a> for Ordered {
    type Writer = EventWriter;

    fn make_writer(&'a self) -> EventWriter {
        EventWriter(self.0)
    }
}

struct EventWriter(&'static Batch);

impl std::io::Write for EventWriter {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.push_event(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Installs the global subscriber. `RUST_LOG` overrides the default filter, which keeps
/// Pingora's own chatter to warnings.
pub fn init(format: LogFormat) {
    let batch: &'static Batch = Box::leak(Box::new(Batch {
        writer: Writer {
            queue: Mutex::new(Queue::default()),
            wake: Condvar::new(),
            drained: Condvar::new(),
        },
        pending: Mutex::new(Pending {
            bytes: Vec::with_capacity(BATCH_BYTES + 1024),
            flusher_waiting: false,
        }),
        arrived: Condvar::new(),
    }));
    let _ = ACCESS.set((batch, format));
    let _ = std::thread::Builder::new()
        .name("sluice-log-write".into())
        .spawn(move || batch.writer.run());
    let _ = std::thread::Builder::new()
        .name("sluice-log-batch".into())
        .spawn(move || batch.run_flusher());
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| {
        EnvFilter::new("info,pingora=warn,pingora_core=warn,pingora_proxy=warn")
    });
    let max_level = filter.max_level_hint();
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(Ordered(batch));
    let installed = match format {
        LogFormat::Json => tracing::subscriber::set_global_default(
            builder
                .json()
                .flatten_event(true)
                .with_current_span(false)
                .finish(),
        ),
        LogFormat::Text => {
            tracing::subscriber::set_global_default(builder.with_ansi(false).finish())
        }
    };
    if installed.is_ok() {
        // Pingora logs through the `log` crate: its lines reach tracing through
        // [`Redacting`], never as they are.
        let level = match max_level {
            Some(l) if l == tracing::level_filters::LevelFilter::OFF => log::LevelFilter::Off,
            Some(l) if l == tracing::level_filters::LevelFilter::ERROR => log::LevelFilter::Error,
            Some(l) if l == tracing::level_filters::LevelFilter::WARN => log::LevelFilter::Warn,
            Some(l) if l == tracing::level_filters::LevelFilter::INFO => log::LevelFilter::Info,
            Some(l) if l == tracing::level_filters::LevelFilter::DEBUG => log::LevelFilter::Debug,
            _ => log::LevelFilter::Trace,
        };
        if log::set_boxed_logger(Box::new(Redacting(tracing_log::LogTracer::new()))).is_ok() {
            log::set_max_level(level);
        }
    }
}

/// The bridge from the `log` crate (Pingora's own lines) to tracing, with [`redact`] applied:
/// Pingora's messages quote request URLs with their query, raw request heads and `Host`
/// values, which sluice's logs never carry. Pingora's debug and trace lines are dropped
/// whatever `RUST_LOG` says: they quote whole request and response heads (with the keys
/// sluice injects) and body bytes (with whatever a member echoes), which no redaction of
/// free text can reliably find.
struct Redacting(tracing_log::LogTracer);

/// Whether a `log` record may be written at all. Besides Pingora's, the file watcher's trace
/// lines are dropped: they report every event in the config file's directory, so a log file
/// kept there would feed itself, a line per line, for ever.
fn admitted(metadata: &log::Metadata<'_>) -> bool {
    let target = metadata.target();
    match metadata.level() {
        log::Level::Error | log::Level::Warn | log::Level::Info => true,
        log::Level::Debug => !target.starts_with("pingora"),
        log::Level::Trace => !target.starts_with("pingora") && !target.starts_with("notify"),
    }
}

impl log::Log for Redacting {
    fn enabled(&self, metadata: &log::Metadata<'_>) -> bool {
        admitted(metadata) && self.0.enabled(metadata)
    }

    fn log(&self, record: &log::Record<'_>) {
        if !admitted(record.metadata()) || !self.0.enabled(record.metadata()) {
            return;
        }
        // A String per line: Pingora logs only on failures, and only those past the filter.
        let text = record.args().to_string();
        let clean = redact(&text);
        self.0.log(
            &log::Record::builder()
                .metadata(record.metadata().clone())
                .module_path(record.module_path())
                .file(record.file())
                .line(record.line())
                .args(format_args!("{clean}"))
                .build(),
        );
    }

    fn flush(&self) {}
}

/// What a `?`-query or a quoted request head is replaced by in Pingora's lines.
const REDACTED_QUERY: &str = "?[query redacted]";
const REDACTED_HEAD: &str = "[request bytes redacted]";
const REDACTED_VALUE: &str = "[redacted]";

/// Pingora's log text made fit for sluice's logs:
/// - a raw request head it quotes (`buf: ...`, on a parse failure) is cut;
/// - a query string (a `?` followed by anything but a space) becomes `?[query redacted]`;
/// - URL credentials (`scheme://user:pass@`) become `[redacted]@`;
/// - the value of a header field it names (`Host: `, `Authorization: `, ...) becomes
///   `[redacted]`.
pub fn redact(text: &str) -> std::borrow::Cow<'_, str> {
    const FIELD_NAMES: &[&str] = &[
        "host: ",
        "authorization: ",
        "proxy-authorization: ",
        "cookie: ",
        "set-cookie: ",
        "x-api-key: ",
    ];
    let lower = text.to_ascii_lowercase();
    let suspicious = text.contains('?')
        || text.contains("buf:")
        || text.contains('@')
        || FIELD_NAMES.iter().any(|f| lower.contains(f));
    if !suspicious {
        return std::borrow::Cow::Borrowed(text);
    }
    let text = match text.find("buf:") {
        Some(at) => &text[..at + 4],
        None => text,
    };
    let cut_head = text.len() < lower.len();
    let lower = &lower[..text.len()];
    let is_end = |c: char| c.is_whitespace() || matches!(c, '"' | '\'' | ',' | ')' | ']' | '>');
    let mut out = String::with_capacity(text.len() + 32);
    let mut rest = text;
    let mut rest_lower = lower;
    while !rest.is_empty() {
        // The next thing to redact: a query, credentials before an `@`, a named field value.
        let query = rest
            .char_indices()
            .find(|&(i, c)| c == '?' && rest[i + 1..].chars().next().is_some_and(|n| !is_end(n)))
            .map(|(i, _)| i);
        let field = FIELD_NAMES
            .iter()
            .filter_map(|f| rest_lower.find(f).map(|i| (i, f.len())))
            .min();
        let userinfo = rest.find("://").and_then(|i| {
            let after = &rest[i + 3..];
            let end = after
                .find(|c: char| is_end(c) || c == '/')
                .unwrap_or(after.len());
            after[..end].rfind('@').map(|at| (i + 3, at))
        });
        let next = [
            query.map(|i| (i, 0)),
            field.map(|(i, _)| (i, 1)),
            userinfo.map(|(i, _)| (i, 2)),
        ]
        .into_iter()
        .flatten()
        .min();
        let Some((at, kind)) = next else {
            out.push_str(rest);
            break;
        };
        let skip = match kind {
            0 => {
                out.push_str(&rest[..at]);
                out.push_str(REDACTED_QUERY);
                let after = &rest[at..];
                at + after.find(is_end).unwrap_or(after.len())
            }
            1 => {
                let len = field.map_or(0, |f| f.1);
                out.push_str(&rest[..at + len]);
                out.push_str(REDACTED_VALUE);
                let after = &rest[at + len..];
                at + len + after.find([',', '\n', '\r']).unwrap_or(after.len())
            }
            _ => {
                let at_sign = userinfo.map_or(0, |u| u.1);
                out.push_str(&rest[..at]);
                out.push_str(REDACTED_VALUE);
                at + at_sign
            }
        };
        rest = &rest[skip..];
        rest_lower = &rest_lower[skip..];
    }
    if cut_head {
        out.push(' ');
        out.push_str(REDACTED_HEAD);
    }
    std::borrow::Cow::Owned(out)
}

/// Writes out buffered lines; call before exiting the process. Waits at most
/// [`FLUSH_WAIT`] for stderr, so that an exit never hangs on a stuck reader.
pub fn flush() {
    if let Some((batch, _)) = ACCESS.get() {
        batch.flush();
        batch.writer.wait_drained(FLUSH_WAIT);
    }
}

/// One access-log line. Every field is documented, with its unit, in docs/operations.md ("Access log").
#[derive(Default)]
pub struct AccessLine<'a> {
    /// The route, or `_none`.
    pub route: &'a str,
    /// The request method.
    pub method: &'a str,
    /// The authority the request was routed by.
    pub authority: &'a str,
    /// The path, without the query.
    pub path: &'a str,
    /// The query, without `?`; written only with `log.query: true` ([`set_log_query`]), with
    /// the values of secret-looking parameters redacted.
    pub query: Option<&'a str>,
    /// The status sent, 0 when none was.
    pub status: u16,
    /// The member of the last attempt, or empty.
    pub member: &'a str,
    /// The members tried, in order (route members: their names are the config's).
    pub members_tried: Option<&'a EachName<'a>>,
    /// Upstream attempts made.
    pub attempts: u32,
    /// Time from the request head to the end, in milliseconds.
    pub duration_ms: f64,
    /// The client's address.
    pub client: Option<SocketAddr>,
    /// Body bytes read from the client.
    pub bytes_in: u64,
    /// Body bytes sent to the client.
    pub bytes_out: u64,
    /// The member's address of the last attempt.
    pub upstream_addr: Option<SocketAddr>,
    /// The last attempt's connect time (TCP and TLS), when it opened a new connection.
    pub connect_ms: Option<f64>,
    /// From the request head to the member's response head.
    pub ttfb_ms: Option<f64>,
    /// The client's `User-Agent`, cut to [`MAX_USER_AGENT`] bytes.
    pub user_agent: Option<&'a str>,
    /// The request id (`X-Request-Id`, the client's or sluice's).
    pub request_id: Option<&'a str>,
    /// The trace id and sluice's span id.
    pub trace: Option<([u8; 16], [u8; 8])>,
    /// What failed, if anything: one of sluice's codes (docs/operations.md, "Access log").
    pub error: Option<&'a str>,
    /// What went wrong, in words, when `error` alone does not say it.
    pub detail: Option<&'a str>,
    /// A CONNECT tunnel's bytes: up (client to member) and down.
    pub tunnel: Option<(u64, u64)>,
}

/// Calls its argument with each name of a list, in order: how a line gets the names of the
/// members tried without a `Vec` being made for it.
pub type EachName<'a> = dyn Fn(&mut dyn FnMut(&str)) + 'a;

/// A `User-Agent` longer than this is cut: a log line is no place for a client's kilobytes.
pub const MAX_USER_AGENT: usize = 256;

/// `log.query`: whether access lines carry the query. Set once at start.
static LOG_QUERY: AtomicBool = AtomicBool::new(false);

/// Applies `log.query` (a restart setting).
pub fn set_log_query(on: bool) {
    LOG_QUERY.store(on, Ordering::Relaxed);
}

thread_local! {
    /// Each worker thread formats its lines in one buffer it keeps.
    static LINE: RefCell<String> = RefCell::new(String::with_capacity(1024));
    /// The current second as a timestamp's text, `YYYY-MM-DDTHH:MM:SS`: formatting the date
    /// is most of the work, and a busy thread writes many lines a second.
    static SECOND: Cell<(u64, [u8; 19])> = const { Cell::new((u64::MAX, [0; 19])) };
}

/// Appends `now` as RFC 3339 UTC to the microsecond, as `humantime` writes it
/// (`2026-12-01T08:20:43.123456Z`), formatting the date once a second per thread.
fn push_timestamp(buf: &mut String, now: SystemTime) {
    let since = now.duration_since(SystemTime::UNIX_EPOCH).ok();
    let Some(since) = since.filter(|d| d.as_secs() < 253_402_300_800) else {
        // Before 1970 or after 9999: humantime's own text, whatever it is.
        let _ = write!(buf, "{}", humantime::format_rfc3339_micros(now));
        return;
    };
    let secs = since.as_secs();
    let (cached, mut text) = SECOND.get();
    if cached != secs {
        let formatted =
            humantime::format_rfc3339_seconds(SystemTime::UNIX_EPOCH + Duration::from_secs(secs))
                .to_string();
        // `YYYY-MM-DDTHH:MM:SSZ` for every year in range (checked above).
        text.copy_from_slice(&formatted.as_bytes()[..19]);
        SECOND.set((secs, text));
    }
    let mut out = [0u8; 27];
    out[..19].copy_from_slice(&text);
    out[19] = b'.';
    let mut micros = since.subsec_micros();
    for digit in out[20..26].iter_mut().rev() {
        *digit = b'0' + (micros % 10) as u8;
        micros /= 10;
    }
    out[26] = b'Z';
    // Digits and the ASCII the date format is made of.
    buf.push_str(std::str::from_utf8(&out).unwrap_or(""));
}

/// Writes an access line, unless `RUST_LOG` leaves `sluice::access` out.
///
/// Access lines are the one log line per request, so they skip tracing's generic field
/// machinery (a map of values per event, then JSON encoding): this writes the same line
/// straight into a reused buffer, which measured about a third of the gateway's CPU per request
/// with the generic path.
pub fn access(line: &AccessLine<'_>) {
    if !tracing::enabled!(target: "sluice::access", tracing::Level::INFO) {
        return;
    }
    let Some((batch, format)) = ACCESS.get() else {
        return;
    };
    LINE.with_borrow_mut(|buf| {
        buf.clear();
        let now = SystemTime::now();
        match format {
            LogFormat::Json => {
                buf.push_str("{\"timestamp\":\"");
                push_timestamp(buf, now);
                buf.push_str("\",\"level\":\"INFO\"");
                fields::<Json>(buf, line);
                buf.push_str(",\"target\":\"sluice::access\"}\n");
            }
            LogFormat::Text => {
                push_timestamp(buf, now);
                buf.push_str("  INFO sluice::access:");
                fields::<Text>(buf, line);
                buf.push('\n');
            }
        }
        batch.push(buf.as_bytes());
    });
}

/// Writes the fields of `line`, in one order for both formats.
fn fields<F: Format>(buf: &mut String, line: &AccessLine<'_>) {
    F::str(buf, field!("route"), line.route);
    F::str(buf, field!("method"), line.method);
    F::str(buf, field!("authority"), line.authority);
    F::str(buf, field!("path"), line.path);
    if let Some(q) = line.query.filter(|_| LOG_QUERY.load(Ordering::Relaxed)) {
        F::name(buf, field!("query"));
        F::open(buf);
        redacted_query(buf, q, F::escape);
        F::close(buf);
    }
    F::num(buf, field!("status"), line.status.into());
    F::str(buf, field!("member"), line.member);
    if let Some(each) = line.members_tried {
        F::name(buf, field!("members_tried"));
        F::list(buf, each);
    }
    F::num(buf, field!("attempts"), line.attempts.into());
    F::ms(buf, field!("duration_ms"), line.duration_ms);
    if let Some(c) = line.client {
        F::addr(buf, field!("client"), c);
    }
    F::num(buf, field!("bytes_in"), line.bytes_in);
    F::num(buf, field!("bytes_out"), line.bytes_out);
    if let Some(a) = line.upstream_addr {
        F::addr(buf, field!("upstream_addr"), a);
    }
    if let Some(ms) = line.connect_ms {
        F::ms(buf, field!("connect_ms"), ms);
    }
    if let Some(ms) = line.ttfb_ms {
        F::ms(buf, field!("ttfb_ms"), ms);
    }
    if let Some(ua) = line.user_agent {
        F::quoted(buf, field!("user_agent"), cut(ua, MAX_USER_AGENT));
    }
    if let Some(id) = line.request_id {
        F::quoted(buf, field!("request_id"), id);
    }
    if let Some((trace, span)) = &line.trace {
        for (name, id) in [
            (field!("trace_id"), &trace[..]),
            (field!("span_id"), &span[..]),
        ] {
            F::name(buf, name);
            F::open(buf);
            push_hex(buf, id);
            F::close(buf);
        }
    }
    if let Some(e) = line.error {
        F::str(buf, field!("error"), e);
    }
    if let Some(d) = line.detail {
        F::quoted(buf, field!("detail"), d);
    }
    if let Some((up, down)) = line.tunnel {
        F::num(buf, field!("bytes_up"), up);
        F::num(buf, field!("bytes_down"), down);
    }
}

/// A field's name, as each format writes it before the value: one `push_str`, where the
/// name between its separators took three (about 50 instructions a field, 15 fields a line).
struct Field {
    json: &'static str,
    text: &'static str,
}

macro_rules! field {
    ($name:literal) => {
        &Field {
            json: concat!(",\"", $name, "\":"),
            text: concat!(" ", $name, "="),
        }
    };
}
use field;

/// How a line's fields are written: JSON (`,"name":value`) or text (` name=value`).
trait Format {
    /// The separator and the field's name.
    fn name(buf: &mut String, name: &Field);
    /// Opens and closes a string value.
    fn open(buf: &mut String);
    fn close(buf: &mut String);
    /// Appends part of a string value.
    fn escape(buf: &mut String, s: &str);
    /// A string field that reads plainly in text (names, codes, paths).
    fn str(buf: &mut String, name: &Field, v: &str) {
        Self::name(buf, name);
        Self::open(buf);
        Self::escape(buf, v);
        Self::close(buf);
    }
    /// A string field of free text, quoted in text too.
    fn quoted(buf: &mut String, name: &Field, v: &str);
    /// A whole number.
    fn num(buf: &mut String, name: &Field, v: u64) {
        Self::name(buf, name);
        push_u64(buf, v);
    }
    /// Milliseconds, to the microsecond.
    fn ms(buf: &mut String, name: &Field, ms: f64) {
        Self::name(buf, name);
        let us = (ms * 1000.0).round() as u64;
        push_u64(buf, us / 1000);
        buf.push('.');
        let frac = us % 1000;
        if frac < 100 {
            buf.push('0');
        }
        if frac < 10 {
            buf.push('0');
        }
        push_u64(buf, frac);
    }
    /// A socket address, a string in JSON.
    fn addr(buf: &mut String, name: &Field, a: SocketAddr) {
        Self::name(buf, name);
        Self::open(buf);
        match a {
            SocketAddr::V4(v4) => push_v4(buf, v4),
            SocketAddr::V6(_) => {
                let _ = write!(buf, "{a}");
            }
        }
        Self::close(buf);
    }
    /// A list of strings.
    fn list(buf: &mut String, each: &EachName<'_>);
}

struct Json;

impl Format for Json {
    fn name(buf: &mut String, name: &Field) {
        buf.push_str(name.json);
    }
    fn open(buf: &mut String) {
        buf.push('"');
    }
    fn close(buf: &mut String) {
        buf.push('"');
    }
    fn escape(buf: &mut String, s: &str) {
        json_escape(buf, s);
    }
    fn quoted(buf: &mut String, name: &Field, v: &str) {
        Self::str(buf, name, v);
    }
    fn list(buf: &mut String, each: &EachName<'_>) {
        buf.push('[');
        let mut first = true;
        each(&mut |name| {
            if !std::mem::take(&mut first) {
                buf.push(',');
            }
            json_str(buf, name);
        });
        buf.push(']');
    }
}

struct Text;

impl Format for Text {
    fn name(buf: &mut String, name: &Field) {
        buf.push_str(name.text);
    }
    fn open(_: &mut String) {}
    fn close(_: &mut String) {}
    fn escape(buf: &mut String, s: &str) {
        buf.push_str(s);
    }
    fn quoted(buf: &mut String, name: &Field, v: &str) {
        Self::name(buf, name);
        let _ = write!(buf, "{v:?}");
    }
    fn list(buf: &mut String, each: &EachName<'_>) {
        let mut first = true;
        each(&mut |name| {
            if !std::mem::take(&mut first) {
                buf.push(',');
            }
            buf.push_str(name);
        });
    }
}

/// `s` cut to at most `max` bytes, on a character boundary.
fn cut(s: &str, max: usize) -> &str {
    if s.len() <= max {
        return s;
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}

// Numbers, addresses and ids are written by hand: `write!` goes through `core::fmt`, which
// cost about 4,000 instructions per line for the access line's fields (callgrind).
fn push_hex(buf: &mut String, bytes: &[u8]) {
    let mut out = [0u8; 32];
    let n = bytes.len().min(16);
    crate::trace::hex_into(&mut out[..2 * n], &bytes[..n]);
    // Hex digits are ASCII.
    buf.push_str(std::str::from_utf8(&out[..2 * n]).unwrap_or(""));
}

/// An IPv4 address and port, `a.b.c.d:port`, put together on the stack and appended once.
fn push_v4(buf: &mut String, a: std::net::SocketAddrV4) {
    let mut out = [0u8; 21];
    let mut n = crate::headers::ipv4_text(&mut out, *a.ip());
    out[n] = b':';
    n += 1;
    let mut port = itoa::Buffer::new();
    let port = port.format(a.port()).as_bytes();
    out[n..n + port.len()].copy_from_slice(port);
    n += port.len();
    // Digits, dots and a colon: ASCII.
    buf.push_str(std::str::from_utf8(&out[..n]).unwrap_or(""));
}

fn push_u64(buf: &mut String, v: u64) {
    // itoa writes two digits per step from a table, with no UTF-8 check on the way out: a
    // tenth of the digit-at-a-time loop it replaced, called about ten times per line.
    buf.push_str(itoa::Buffer::new().format(v));
}

/// Whether a query parameter's value is redacted from the log: its name, lowercased,
/// contains one of these. Broad on purpose: a parameter logged in vain costs less than a key
/// in a log.
const SECRET_PARAMS: &[&str] = &[
    "key",
    "token",
    "secret",
    "passw",
    "pwd",
    "sig",
    "auth",
    "credential",
    "session",
];

/// What replaces a secret parameter's value.
pub const REDACTED: &str = "REDACTED";

/// Appends `query` with the value of every parameter whose name looks secret (see
/// [`SECRET_PARAMS`]; the name compared as sent, percent-escapes and all) replaced by
/// [`REDACTED`]. `put` escapes for the format.
fn redacted_query(buf: &mut String, query: &str, put: fn(&mut String, &str)) {
    for (i, pair) in query.split('&').enumerate() {
        if i > 0 {
            buf.push('&');
        }
        let (name, value) = match pair.split_once('=') {
            Some((n, v)) => (n, Some(v)),
            None => (pair, None),
        };
        put(buf, name);
        if let Some(value) = value {
            buf.push('=');
            if is_secret_param(name) {
                buf.push_str(REDACTED);
            } else {
                put(buf, value);
            }
        }
    }
}

fn is_secret_param(name: &str) -> bool {
    let mut lower = [0u8; 64];
    let n = name.len().min(lower.len());
    for (l, b) in lower.iter_mut().zip(name.bytes()) {
        *l = b.to_ascii_lowercase();
    }
    let lower = &lower[..n];
    // A name longer than the buffer is judged by its start, and redacted when unsure.
    name.len() > 64
        || SECRET_PARAMS
            .iter()
            .any(|s| lower.windows(s.len()).any(|w| w == s.as_bytes()))
}

/// Appends `s` as a JSON string.
///
/// By bytes, copying the runs between escapes whole: the characters to escape are ASCII,
/// and an ASCII byte is never part of a longer UTF-8 sequence. (Pushing char by char cost
/// about 1,500 instructions per access line.)
fn json_str(buf: &mut String, s: &str) {
    buf.push('"');
    json_escape(buf, s);
    buf.push('"');
}

/// Appends `s` JSON-escaped, without the quotes.
fn json_escape(buf: &mut String, s: &str) {
    let mut rest = s;
    while let Some(i) = first_to_escape(rest.as_bytes()) {
        buf.push_str(&rest[..i]);
        match rest.as_bytes()[i] {
            b'"' => buf.push_str("\\\""),
            b'\\' => buf.push_str("\\\\"),
            b => {
                let mut hex = [0u8; 2];
                crate::trace::hex_into(&mut hex, &[b]);
                buf.push_str("\\u00");
                buf.extend(hex.map(char::from));
            }
        }
        // The byte escaped is ASCII, so `i + 1` is a character boundary.
        rest = &rest[i + 1..];
    }
    buf.push_str(rest);
}

/// The index of the first byte JSON needs escaped: `"`, `\` or a control character.
///
/// Eight bytes at a time, with the word tricks for "some byte is zero" and "some byte is less
/// than n": most fields have nothing to escape, and a byte at a time cost about 15
/// instructions a byte. In each test a borrow can only flag a byte *above* a true match, so the
/// lowest flagged byte (the first, read little-endian) is a true one.
fn first_to_escape(s: &[u8]) -> Option<usize> {
    const ONES: u64 = u64::from_ne_bytes([1; 8]);
    const HIGH: u64 = ONES * 0x80;
    let zero_in = |w: u64| w.wrapping_sub(ONES) & !w & HIGH;
    let mut chunks = s.chunks_exact(8);
    let mut at = 0;
    for chunk in &mut chunks {
        let mut word = [0; 8];
        word.copy_from_slice(chunk);
        let w = u64::from_le_bytes(word);
        let control = w.wrapping_sub(ONES * 0x20) & !w & HIGH;
        let hits = control
            | zero_in(w ^ (ONES * u64::from(b'"')))
            | zero_in(w ^ (ONES * u64::from(b'\\')));
        if hits != 0 {
            return Some(at + (hits.trailing_zeros() / 8) as usize);
        }
        at += 8;
    }
    let tail = chunks.remainder();
    tail.iter()
        .position(|&b| b < 0x20 || b == b'"' || b == b'\\')
        .map(|i| at + i)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn json_escape_round_trips_through_a_json_parser(s in any::<String>()) {
            let mut out = String::new();
            json_str(&mut out, &s);
            prop_assert_eq!(serde_json::from_str::<String>(&out).ok(), Some(s.clone()));
            // Only what JSON requires is escaped: the rest goes as it came.
            let plain = s.bytes().all(|b| b >= 0x20 && b != b'"' && b != b'\\');
            prop_assert_eq!(plain, out.len() == s.len() + 2);
        }

        #[test]
        fn the_word_scan_finds_the_first_byte_to_escape(
            bytes in prop::collection::vec(prop_oneof![Just(b'"'), Just(b'\\'), 0u8..0x20, 0x20u8..=0xff, 0x20u8..0x7f], 0..40)
        ) {
            let byte_at_a_time = bytes.iter().position(|&b| b < 0x20 || b == b'"' || b == b'\\');
            prop_assert_eq!(first_to_escape(&bytes), byte_at_a_time);
        }

        #[test]
        fn timestamps_read_as_humantime_writes_them(
            secs in prop_oneof![0u64..253_402_300_800, 1_700_000_000u64..1_900_000_000],
            micros in 0u32..1_000_000,
            later in 0u32..3_000_000,
        ) {
            // Two times, the second often in the same second as the first: the cached date
            // is used, and replaced when the second changes.
            let first = SystemTime::UNIX_EPOCH + Duration::new(secs, micros * 1000);
            for t in [first, first + Duration::from_micros(later.into())] {
                let mut out = String::new();
                push_timestamp(&mut out, t);
                prop_assert_eq!(out, humantime::format_rfc3339_micros(t).to_string());
            }
        }

        #[test]
        fn ipv4_addresses_read_as_std_writes_them(ip in any::<u32>(), port in any::<u16>()) {
            let a = std::net::SocketAddrV4::new(ip.into(), port);
            let mut out = String::new();
            push_v4(&mut out, a);
            prop_assert_eq!(out, a.to_string());
        }
    }

    #[test]
    fn pingora_lines_lose_queries_heads_credentials_and_field_values() {
        let line = "Fail to proxy: Upstream ConnectRefused, tries: 1, retry: true, GET /v1/x?q=secret&key=k, Host: api.example";
        let clean = redact(line);
        assert!(
            !clean.contains("secret") && !clean.contains("api.example"),
            "{clean}"
        );
        assert!(
            clean.contains("GET /v1/x?[query redacted], Host: [redacted]"),
            "{clean}"
        );
        let clean = redact(
            "InvalidHTTPHeader context: buf: GET /?token=s HTTP/1.1\r\nAuthorization: Bearer s",
        );
        assert_eq!(
            clean,
            "InvalidHTTPHeader context: buf: [request bytes redacted]"
        );
        let clean = redact("connect to http://user:pw@proxy.example:3128/ failed");
        assert_eq!(
            clean,
            "connect to http://[redacted]@proxy.example:3128/ failed"
        );
        assert_eq!(redact("why? because"), "why? because");
        assert!(matches!(redact("plain"), std::borrow::Cow::Borrowed(_)));
    }

    #[test]
    fn numbers_and_addresses_are_written_by_hand_as_fmt_would() {
        let mut buf = String::new();
        for v in [0, 7, 10, 999, 1000, u64::MAX] {
            buf.clear();
            push_u64(&mut buf, v);
            assert_eq!(buf, v.to_string());
        }
        for ms in [0.0, 0.0004, 1.5, 12.3456, 1000.001] {
            buf.clear();
            Json::ms(&mut buf, field!("x"), ms);
            assert_eq!(buf, format!(",\"x\":{ms:.3}"));
        }
        for a in ["127.0.0.1:8080", "10.200.3.4:1", "[::1]:443"] {
            buf.clear();
            Text::addr(&mut buf, field!("a"), a.parse().unwrap());
            assert_eq!(buf, format!(" a={a}"));
        }
        buf.clear();
        push_hex(&mut buf, &[0x00, 0xab, 0x0f]);
        assert_eq!(buf, "00ab0f");
    }

    #[test]
    fn secret_query_values_are_redacted() {
        let mut buf = String::new();
        redacted_query(
            &mut buf,
            "q=cats&api_key=k1&Token=t&page=2&flag&SIG=s",
            |b, s| b.push_str(s),
        );
        assert_eq!(
            buf,
            "q=cats&api_key=REDACTED&Token=REDACTED&page=2&flag&SIG=REDACTED"
        );
        buf.clear();
        redacted_query(&mut buf, "q=\"x\"", json_escape);
        assert_eq!(buf, r#"q=\"x\""#);
    }

    #[test]
    fn json_strings_are_escaped() {
        let mut buf = String::new();
        json_str(&mut buf, "a\"b\\c\nd");
        assert_eq!(buf, r#""a\"b\\c\u000ad""#);
        let parsed: String = serde_json::from_str(&buf).unwrap();
        assert_eq!(parsed, "a\"b\\c\nd");
        buf.clear();
        json_str(&mut buf, "\u{1}é\u{1f}x\"");
        assert_eq!(buf, r#""\u0001é\u001fx\"""#);
    }
}
