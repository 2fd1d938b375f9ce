//! Keeping secrets out of log lines: Pingora's own lines, redacted on their way through the
//! `log` bridge, and the query of an access line, whose secret-looking values are replaced.

use std::fmt;

/// The bridge from the `log` crate (Pingora's own lines) to tracing, with [`redact`] applied:
/// Pingora's messages quote request URLs with their query, raw request heads and `Host`
/// values, which sluice's logs never carry. Pingora's debug and trace lines are dropped
/// whatever `RUST_LOG` says: they quote whole request and response heads (with the keys
/// sluice injects) and body bytes (with whatever a member echoes), which no redaction of
/// free text can reliably find.
pub(super) struct Redacting(pub(super) tracing_log::LogTracer);

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

/// A query, written with the value of every parameter whose name looks secret (see
/// [`SECRET_PARAMS`]; the name compared as sent, percent-escapes and all) replaced by
/// [`REDACTED`]. Written piece by piece, so that the line's format escapes it on the way in.
pub(super) struct RedactedQuery<'a>(pub(super) &'a str);

impl fmt::Display for RedactedQuery<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, pair) in self.0.split('&').enumerate() {
            if i > 0 {
                f.write_str("&")?;
            }
            let (name, value) = match pair.split_once('=') {
                Some((n, v)) => (n, Some(v)),
                None => (pair, None),
            };
            f.write_str(name)?;
            if let Some(value) = value {
                f.write_str("=")?;
                f.write_str(if is_secret_param(name) {
                    REDACTED
                } else {
                    value
                })?;
            }
        }
        Ok(())
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

#[cfg(test)]
mod tests {
    use super::*;

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
    fn secret_query_values_are_redacted() {
        assert_eq!(
            RedactedQuery("q=cats&api_key=k1&Token=t&page=2&flag&SIG=s").to_string(),
            "q=cats&api_key=REDACTED&Token=REDACTED&page=2&flag&SIG=REDACTED"
        );
    }
}
