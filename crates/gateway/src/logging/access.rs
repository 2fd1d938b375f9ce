//! The access line: one per request, in JSON or text, written straight into a buffer each
//! thread keeps and appended to the writer's batch.

use std::cell::{Cell, RefCell};
use std::io::Write as _;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, SystemTime};

use serde::Serializer as _;

use super::redact::RedactedQuery;
use super::{LogFormat, ACCESS};

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
    /// The routes the request left for their `fallback`, in order; none when it left none.
    pub fallback_from: Option<&'a EachName<'a>>,
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
    /// The identified client's name (`clients`).
    pub client_name: Option<&'a str>,
    /// `would_deny` when `clients.mode: report` let a refusal go.
    pub authz: Option<&'a str>,
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
    static LINE: RefCell<Vec<u8>> = RefCell::new(Vec::with_capacity(1024));
    /// The current second as a timestamp's text, `YYYY-MM-DDTHH:MM:SS`: formatting the date
    /// is most of the work, and a busy thread writes many lines a second.
    static SECOND: Cell<(u64, [u8; 19])> = const { Cell::new((u64::MAX, [0; 19])) };
}

/// Appends `now` as RFC 3339 UTC to the microsecond, as `humantime` writes it
/// (`2026-12-01T08:20:43.123456Z`), formatting the date once a second per thread.
fn push_timestamp(buf: &mut Vec<u8>, now: SystemTime) {
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
    buf.extend_from_slice(&out);
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
                buf.extend_from_slice(b"{\"timestamp\":\"");
                push_timestamp(buf, now);
                buf.extend_from_slice(b"\",\"level\":\"INFO\"");
                fields::<Json>(buf, line);
                buf.extend_from_slice(b",\"target\":\"sluice::access\"}\n");
            }
            LogFormat::Text => {
                push_timestamp(buf, now);
                buf.extend_from_slice(b"  INFO sluice::access:");
                fields::<Text>(buf, line);
                buf.push(b'\n');
            }
        }
        batch.push(buf);
    });
}

/// Writes the fields of `line`, in one order for both formats.
fn fields<F: Format>(buf: &mut Vec<u8>, line: &AccessLine<'_>) {
    F::str(buf, field!("route"), line.route);
    F::str(buf, field!("method"), line.method);
    F::str(buf, field!("authority"), line.authority);
    F::str(buf, field!("path"), line.path);
    if let Some(q) = line.query.filter(|_| LOG_QUERY.load(Ordering::Relaxed)) {
        F::query(buf, field!("query"), q);
    }
    F::num(buf, field!("status"), line.status.into());
    F::str(buf, field!("member"), line.member);
    if let Some(each) = line.members_tried {
        F::name(buf, field!("members_tried"));
        F::list(buf, each);
    }
    if let Some(each) = line.fallback_from {
        F::name(buf, field!("fallback_from"));
        F::list(buf, each);
    }
    F::num(buf, field!("attempts"), line.attempts.into());
    F::ms(buf, field!("duration_ms"), line.duration_ms);
    if let Some(c) = line.client {
        F::addr(buf, field!("client"), c);
    }
    if let Some(name) = line.client_name {
        F::str(buf, field!("client_name"), name);
    }
    if let Some(authz) = line.authz {
        F::str(buf, field!("authz"), authz);
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
    fn name(buf: &mut Vec<u8>, name: &Field);
    /// Opens and closes a string value whose text needs no escaping in either format (hex
    /// ids, addresses).
    fn open(buf: &mut Vec<u8>);
    fn close(buf: &mut Vec<u8>);
    /// A string field that reads plainly in text (names, codes, paths).
    fn str(buf: &mut Vec<u8>, name: &Field, v: &str);
    /// A string field of free text, quoted in text too.
    fn quoted(buf: &mut Vec<u8>, name: &Field, v: &str);
    /// The query, with the values of secret-looking parameters redacted.
    fn query(buf: &mut Vec<u8>, name: &Field, q: &str);
    /// A whole number.
    fn num(buf: &mut Vec<u8>, name: &Field, v: u64) {
        Self::name(buf, name);
        push_u64(buf, v);
    }
    /// Milliseconds, to the microsecond.
    fn ms(buf: &mut Vec<u8>, name: &Field, ms: f64) {
        Self::name(buf, name);
        let us = (ms * 1000.0).round() as u64;
        // Put together on the stack and appended once, as `push_v4` does.
        let mut whole = itoa::Buffer::new();
        let whole = whole.format(us / 1000).as_bytes();
        let mut out = [0u8; 24];
        out[..whole.len()].copy_from_slice(whole);
        let frac = us % 1000;
        out[whole.len()..whole.len() + 4].copy_from_slice(&[
            b'.',
            b'0' + (frac / 100) as u8,
            b'0' + (frac / 10 % 10) as u8,
            b'0' + (frac % 10) as u8,
        ]);
        buf.extend_from_slice(&out[..whole.len() + 4]);
    }
    /// A socket address, a string in JSON; the address alone for port 0, which no peer has
    /// (an address a trusted proxy's `X-Forwarded-For` named).
    fn addr(buf: &mut Vec<u8>, name: &Field, a: SocketAddr) {
        Self::name(buf, name);
        Self::open(buf);
        match a {
            _ if a.port() == 0 => {
                let _ = write!(buf, "{}", a.ip());
            }
            SocketAddr::V4(v4) => push_v4(buf, v4),
            SocketAddr::V6(_) => {
                let _ = write!(buf, "{a}");
            }
        }
        Self::close(buf);
    }
    /// A list of strings.
    fn list(buf: &mut Vec<u8>, each: &EachName<'_>);
}

struct Json;

impl Format for Json {
    fn name(buf: &mut Vec<u8>, name: &Field) {
        buf.extend_from_slice(name.json.as_bytes());
    }
    fn open(buf: &mut Vec<u8>) {
        buf.push(b'"');
    }
    fn close(buf: &mut Vec<u8>) {
        buf.push(b'"');
    }
    fn str(buf: &mut Vec<u8>, name: &Field, v: &str) {
        Self::name(buf, name);
        json_str(buf, v);
    }
    fn quoted(buf: &mut Vec<u8>, name: &Field, v: &str) {
        Self::str(buf, name, v);
    }
    fn query(buf: &mut Vec<u8>, name: &Field, q: &str) {
        Self::name(buf, name);
        // serde_json escapes each piece as the query is written, straight into `buf`.
        // Writing into a `Vec` cannot fail.
        let _ = (&mut serde_json::Serializer::new(buf)).collect_str(&RedactedQuery(q));
    }
    fn list(buf: &mut Vec<u8>, each: &EachName<'_>) {
        buf.push(b'[');
        let mut first = true;
        each(&mut |name| {
            if !std::mem::take(&mut first) {
                buf.push(b',');
            }
            json_str(buf, name);
        });
        buf.push(b']');
    }
}

struct Text;

impl Format for Text {
    fn name(buf: &mut Vec<u8>, name: &Field) {
        buf.extend_from_slice(name.text.as_bytes());
    }
    fn open(_: &mut Vec<u8>) {}
    fn close(_: &mut Vec<u8>) {}
    fn str(buf: &mut Vec<u8>, name: &Field, v: &str) {
        Self::name(buf, name);
        buf.extend_from_slice(v.as_bytes());
    }
    fn quoted(buf: &mut Vec<u8>, name: &Field, v: &str) {
        Self::name(buf, name);
        let _ = write!(buf, "{v:?}");
    }
    fn query(buf: &mut Vec<u8>, name: &Field, q: &str) {
        Self::name(buf, name);
        let _ = write!(buf, "{}", RedactedQuery(q));
    }
    fn list(buf: &mut Vec<u8>, each: &EachName<'_>) {
        let mut first = true;
        each(&mut |name| {
            if !std::mem::take(&mut first) {
                buf.push(b',');
            }
            buf.extend_from_slice(name.as_bytes());
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

/// Appends `s` as a JSON string, quoted and escaped by serde_json straight into `buf`.
///
/// A string with nothing to escape (every field of a usual line: route, method, authority,
/// path, member, request id) is copied as it is once [`needs_escape`] has looked at it:
/// serde_json's escaper writes through its `Write` calls in pieces, about 140 instructions a
/// field. serde_json escapes the control characters, `"` and `\`, and nothing else, as JSON
/// requires, so the text is the same.
fn json_str(buf: &mut Vec<u8>, s: &str) {
    if !needs_escape(s.as_bytes()) {
        buf.reserve(s.len() + 2);
        buf.push(b'"');
        buf.extend_from_slice(s.as_bytes());
        buf.push(b'"');
        return;
    }
    // Writing into a `Vec` cannot fail.
    let _ = serde_json::to_writer(buf, s);
}

/// Whether `s` has a byte JSON must escape: a control character, `"` or `\`. Eight bytes at
/// a time: a byte-at-a-time scan (`Iterator::all`) cost as much as the escaper it was to spare.
fn needs_escape(s: &[u8]) -> bool {
    const ONES: u64 = u64::from_ne_bytes([0x01; 8]);
    const HIGHS: u64 = u64::from_ne_bytes([0x80; 8]);
    // Some byte of `w` is below `n` (n <= 0x80). A borrow only runs on from a byte that is, so
    // the answer is exact; only which byte it flags may be wrong, and that is not asked.
    let below = |w: u64, n: u8| w.wrapping_sub(ONES * u64::from(n)) & !w & HIGHS != 0;
    // A byte equal to `c` is a zero byte of `w ^ c`, the one byte below 1.
    let escaped = |w: u64| {
        below(w, 0x20)
            || below(w ^ (ONES * u64::from(b'"')), 1)
            || below(w ^ (ONES * u64::from(b'\\')), 1)
    };
    let word = |bytes: &[u8]| u64::from_ne_bytes(bytes.try_into().expect("eight bytes"));
    let mut words = s.chunks_exact(8);
    if words.any(|w| escaped(word(w))) {
        return true;
    }
    // The last bytes as one more word, padded with a byte that needs no escape.
    let rest = words.remainder();
    let mut last = [b'a'; 8];
    last[..rest.len()].copy_from_slice(rest);
    !rest.is_empty() && escaped(word(&last))
}

// Numbers, addresses and ids are written by hand: `write!` goes through `core::fmt`, which
// cost about 4,000 instructions per line for the access line's fields (callgrind).
fn push_hex(buf: &mut Vec<u8>, bytes: &[u8]) {
    let mut out = [0u8; 32];
    let n = bytes.len().min(16);
    crate::trace::hex_into(&mut out[..2 * n], &bytes[..n]);
    buf.extend_from_slice(&out[..2 * n]);
}

/// An IPv4 address and port, `a.b.c.d:port`, put together on the stack and appended once.
fn push_v4(buf: &mut Vec<u8>, a: std::net::SocketAddrV4) {
    let mut out = [0u8; 21];
    let mut n = crate::headers::ipv4_text(&mut out, *a.ip());
    out[n] = b':';
    n += 1;
    let mut port = itoa::Buffer::new();
    let port = port.format(a.port()).as_bytes();
    out[n..n + port.len()].copy_from_slice(port);
    n += port.len();
    buf.extend_from_slice(&out[..n]);
}

fn push_u64(buf: &mut Vec<u8>, v: u64) {
    // itoa writes two digits per step from a table: a tenth of the digit-at-a-time loop it
    // replaced, called about ten times per line.
    buf.extend_from_slice(itoa::Buffer::new().format(v).as_bytes());
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// The line's bytes as text, for comparing.
    fn text(buf: &[u8]) -> &str {
        std::str::from_utf8(buf).expect("UTF-8")
    }

    proptest! {
        #[test]
        fn json_strings_round_trip_through_a_json_parser(s in any::<String>()) {
            let mut out = Vec::new();
            json_str(&mut out, &s);
            // The plain-string shortcut writes exactly what serde_json writes.
            prop_assert_eq!(&out, &serde_json::to_vec(&s).expect("a string serializes"));
            prop_assert_eq!(serde_json::from_slice::<String>(&out).ok(), Some(s.clone()));
            // Only what JSON requires is escaped: the rest goes as it came.
            let plain = s.bytes().all(|b| b >= 0x20 && b != b'"' && b != b'\\');
            prop_assert_eq!(plain, out.len() == s.len() + 2);
        }

        #[test]
        fn queries_are_valid_json_whatever_they_hold(q in any::<String>()) {
            let mut out = Vec::new();
            Json::query(&mut out, field!("query"), &q);
            let value: serde_json::Value = serde_json::from_slice(&out[",\"query\":".len()..]).expect("JSON");
            let redacted = RedactedQuery(&q).to_string();
            prop_assert_eq!(value.as_str(), Some(redacted.as_str()));
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
                let mut out = Vec::new();
                push_timestamp(&mut out, t);
                prop_assert_eq!(text(&out), humantime::format_rfc3339_micros(t).to_string());
            }
        }

        #[test]
        fn ipv4_addresses_read_as_std_writes_them(ip in any::<u32>(), port in any::<u16>()) {
            let a = std::net::SocketAddrV4::new(ip.into(), port);
            let mut out = Vec::new();
            push_v4(&mut out, a);
            prop_assert_eq!(text(&out), a.to_string());
        }
    }

    #[test]
    fn numbers_and_addresses_are_written_by_hand_as_fmt_would() {
        let mut buf = Vec::new();
        for v in [0, 7, 10, 999, 1000, u64::MAX] {
            buf.clear();
            push_u64(&mut buf, v);
            assert_eq!(text(&buf), v.to_string());
        }
        for ms in [0.0, 0.0004, 1.5, 12.3456, 1000.001] {
            buf.clear();
            Json::ms(&mut buf, field!("x"), ms);
            assert_eq!(text(&buf), format!(",\"x\":{ms:.3}"));
        }
        for a in ["127.0.0.1:8080", "10.200.3.4:1", "[::1]:443"] {
            buf.clear();
            Text::addr(&mut buf, field!("a"), a.parse().unwrap());
            assert_eq!(text(&buf), format!(" a={a}"));
        }
        buf.clear();
        push_hex(&mut buf, &[0x00, 0xab, 0x0f]);
        assert_eq!(text(&buf), "00ab0f");
    }

    #[test]
    fn queries_are_redacted_then_escaped_for_the_format() {
        let mut buf = Vec::new();
        Json::query(&mut buf, field!("query"), "q=\"x\"&token=t");
        assert_eq!(text(&buf), r#","query":"q=\"x\"&token=REDACTED""#);
        buf.clear();
        Text::query(&mut buf, field!("query"), "q=\"x\"&token=t");
        assert_eq!(text(&buf), r#" query=q="x"&token=REDACTED"#);
    }

    #[test]
    fn the_escape_scan_finds_every_byte_json_escapes_wherever_it_is() {
        // Every byte value at every place of strings up to three words long, and every pair of
        // byte values in one word: the word-at-a-time test against the byte-at-a-time one.
        let escaped = |b: u8| b < 0x20 || b == b'"' || b == b'\\';
        for len in 1..=24 {
            for at in 0..len {
                for b in 0..=255u8 {
                    let mut s = vec![b'a'; len];
                    s[at] = b;
                    assert_eq!(needs_escape(&s), escaped(b), "{b:#x} at {at} of {len}");
                }
            }
        }
        for a in 0..=255u8 {
            for b in 0..=255u8 {
                for (i, j) in [(0, 1), (3, 7), (6, 7), (0, 7)] {
                    let mut s = [b'x'; 8];
                    s[i] = a;
                    s[j] = b;
                    assert_eq!(needs_escape(&s), escaped(a) || escaped(b), "{a:#x} {b:#x}");
                }
            }
        }
        assert!(!needs_escape(b""));
    }

    #[test]
    fn json_strings_are_escaped() {
        let mut buf = Vec::new();
        json_str(&mut buf, "a\"b\\c\nd");
        assert_eq!(text(&buf), r#""a\"b\\c\nd""#);
        let parsed: String = serde_json::from_slice(&buf).unwrap();
        assert_eq!(parsed, "a\"b\\c\nd");
        buf.clear();
        json_str(&mut buf, "\u{1}é\u{1f}x\"");
        assert_eq!(text(&buf), r#""\u0001é\u001fx\"""#);
    }
}
