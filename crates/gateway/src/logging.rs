//! Logs: one JSON object per line on stderr (access log and events), or text for humans.
//!
//! Lines go through a background writer so that a request never waits on a write to stderr.
//! Access lines, one per request, are first gathered into a batch that reaches the writer
//! in one piece (see [`Batch`]): no queue message, allocation or thread wake-up per request.

use std::cell::RefCell;
use std::fmt::Write as _;
use std::io::Write as _;
use std::sync::{Condvar, Mutex, MutexGuard, OnceLock};
use std::time::{Duration, SystemTime};

use tracing_appender::non_blocking::{NonBlocking, WorkerGuard};
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

static GUARD: Mutex<Option<WorkerGuard>> = Mutex::new(None);

/// Where access lines go: the batch in front of the background writer, and the format.
static ACCESS: OnceLock<(&'static Batch, LogFormat)> = OnceLock::new();

/// A batch is handed to the writer once it holds this many bytes (about a hundred lines)...
const BATCH_BYTES: usize = 32 * 1024;
/// ...or at the latest this long after its first line, by the batch's flusher thread.
const BATCH_DELAY: Duration = Duration::from_millis(20);

/// Access lines waiting for the background writer.
///
/// Sending each line on its own cost a copy into a new `Vec`, a message on the writer's queue
/// and, whenever the writer thread had gone idle, a futex wake-up: per request. Lines now
/// gather here and go to the writer as one message per batch, sent by whoever fills it, or by
/// the flusher thread [`BATCH_DELAY`] after the first line of a quiet moment, or by
/// [`flush`] at exit. The one lock is held only to append a finished line or to hand the
/// batch over; every other line (the tracing events) hands the batch over first, under that
/// lock, so lines keep the order in which they were written.
struct Batch {
    writer: NonBlocking,
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

    /// Sends the batch to the writer; the caller holds the lock, which keeps the order.
    fn hand_over(&self, p: &mut Pending) {
        if !p.bytes.is_empty() {
            // A full queue drops the batch rather than making a request wait.
            let _ = self.writer.clone().write_all(&p.bytes);
            p.bytes.clear();
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

/// The writer tracing's events go through: the access batch is handed over first.
struct Ordered(&'static Batch);

impl<'a> MakeWriter<'a> for Ordered {
    type Writer = NonBlocking;

    fn make_writer(&'a self) -> NonBlocking {
        self.0.flush();
        self.0.writer.clone()
    }
}

/// Installs the global subscriber. `RUST_LOG` overrides the default filter, which keeps
/// Pingora's own chatter to warnings.
pub fn init(format: LogFormat) {
    // The writer thread drains its queue, then flushes: buffered, the lines of a busy moment
    // leave in one write(2) instead of one each, and a quiet gateway still writes at once.
    let stderr = std::io::BufWriter::with_capacity(64 * 1024, std::io::stderr());
    let (writer, guard) = tracing_appender::non_blocking(stderr);
    *GUARD.lock().unwrap_or_else(|p| p.into_inner()) = Some(guard);
    let batch: &'static Batch = Box::leak(Box::new(Batch {
        writer,
        pending: Mutex::new(Pending {
            bytes: Vec::with_capacity(BATCH_BYTES + 1024),
            flusher_waiting: false,
        }),
        arrived: Condvar::new(),
    }));
    let _ = ACCESS.set((batch, format));
    let _ = std::thread::Builder::new()
        .name("sluice-log-batch".into())
        .spawn(move || batch.run_flusher());
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| {
        EnvFilter::new("info,pingora=warn,pingora_core=warn,pingora_proxy=warn")
    });
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(Ordered(batch));
    match format {
        LogFormat::Json => builder
            .json()
            .flatten_event(true)
            .with_current_span(false)
            .init(),
        LogFormat::Text => builder.with_ansi(false).init(),
    }
}

/// Writes out buffered lines; call before exiting the process.
pub fn flush() {
    if let Some((batch, _)) = ACCESS.get() {
        batch.flush();
    }
    GUARD.lock().unwrap_or_else(|p| p.into_inner()).take();
}

/// One access-log line.
pub struct AccessLine<'a> {
    /// The route, or `_none`.
    pub route: &'a str,
    /// The request method.
    pub method: &'a str,
    /// The authority the request was routed by.
    pub authority: &'a str,
    /// The path, without the query.
    pub path: &'a str,
    /// The status sent, 0 when none was.
    pub status: u16,
    /// The member of the last attempt, or empty.
    pub member: &'a str,
    /// Upstream attempts made.
    pub attempts: u32,
    /// Time from the request head to the end, in milliseconds.
    pub duration_ms: f64,
    /// What failed, if anything.
    pub error: Option<&'a str>,
    /// What went wrong, in words, when `error` alone does not say it.
    pub detail: Option<&'a str>,
    /// A CONNECT tunnel's bytes: up (client to member) and down.
    pub tunnel: Option<(u64, u64)>,
}

thread_local! {
    /// Each worker thread formats its lines in one buffer it keeps.
    static LINE: RefCell<String> = RefCell::new(String::with_capacity(512));
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
        let now = humantime::format_rfc3339_micros(SystemTime::now());
        match format {
            LogFormat::Json => {
                let _ = write!(buf, "{{\"timestamp\":\"{now}\",\"level\":\"INFO\",\"route\":");
                json_str(buf, line.route);
                buf.push_str(",\"method\":");
                json_str(buf, line.method);
                buf.push_str(",\"authority\":");
                json_str(buf, line.authority);
                buf.push_str(",\"path\":");
                json_str(buf, line.path);
                let _ = write!(buf, ",\"status\":{},\"member\":", line.status);
                json_str(buf, line.member);
                let _ = write!(
                    buf,
                    ",\"attempts\":{},\"duration_ms\":{:.3}",
                    line.attempts, line.duration_ms
                );
                if let Some(e) = line.error {
                    buf.push_str(",\"error\":");
                    json_str(buf, e);
                }
                if let Some(d) = line.detail {
                    buf.push_str(",\"detail\":");
                    json_str(buf, d);
                }
                if let Some((up, down)) = line.tunnel {
                    let _ = write!(buf, ",\"bytes_up\":{up},\"bytes_down\":{down}");
                }
                buf.push_str(",\"target\":\"sluice::access\"}\n");
            }
            LogFormat::Text => {
                let _ = write!(
                    buf,
                    "{now}  INFO sluice::access: route={} method={} authority={} path={} status={} member={} attempts={} duration_ms={:.3}",
                    line.route, line.method, line.authority, line.path, line.status, line.member, line.attempts, line.duration_ms
                );
                if let Some(e) = line.error {
                    let _ = write!(buf, " error={e}");
                }
                if let Some(d) = line.detail {
                    let _ = write!(buf, " detail={d:?}");
                }
                if let Some((up, down)) = line.tunnel {
                    let _ = write!(buf, " bytes_up={up} bytes_down={down}");
                }
                buf.push('\n');
            }
        }
        batch.push(buf.as_bytes());
    });
}

/// Appends `s` as a JSON string.
///
/// By bytes, copying the runs between escapes whole: the characters to escape are ASCII,
/// and an ASCII byte is never part of a longer UTF-8 sequence. (Pushing char by char cost
/// about 1,500 instructions per access line.)
fn json_str(buf: &mut String, s: &str) {
    buf.push('"');
    let mut start = 0;
    for (i, b) in s.bytes().enumerate() {
        let escaped = match b {
            b'"' => "\\\"",
            b'\\' => "\\\\",
            0..=0x1f => "",
            _ => continue,
        };
        buf.push_str(&s[start..i]);
        if escaped.is_empty() {
            let _ = write!(buf, "\\u{:04x}", b);
        } else {
            buf.push_str(escaped);
        }
        start = i + 1;
    }
    buf.push_str(&s[start..]);
    buf.push('"');
}

#[cfg(test)]
mod tests {
    use super::*;

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
