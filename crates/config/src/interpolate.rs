//! `${NAME}` in config values, read from the environment (SPEC §8).
//!
//! `${NAME}` is the environment variable NAME; `${NAME:-default}` is `default` when NAME is
//! unset *or empty* (as in a POSIX shell); `$${` is a literal `${`. NAME is
//! `[A-Za-z_][A-Za-z0-9_]*`. An unset variable without a default, a bad name and an unterminated
//! `${` are config errors, each shown at its `${`.
//!
//! # Why at the level of YAML events
//!
//! Replacing `${…}` in the text before YAML reads it would let a value change the document:
//! `KEY="x\"\nadmin: {listen: 0.0.0.0:9901}"` would close the string and add a setting.
//! Replacing in the parsed values afterwards would need every field type to take part, and
//! would lose the positions serde reports. So the text is rewritten scalar by scalar instead:
//! libyaml's events (the parser serde_yaml runs on, see `position`) give each scalar's value,
//! style and byte span; a scalar whose *value* holds `${` is expanded and its span replaced by a
//! scalar that YAML can only read back as that one value:
//!
//! - a plain scalar whose result is still a harmless plain word (`[A-Za-z0-9_./+-]`) stays
//!   plain, so `limit: ${LIMIT}` is the number 60, as if `60` had been written;
//! - everything else becomes a double-quoted scalar in which every character outside printable
//!   ASCII, and `"` and `\`, is escaped. That is stricter than JSON's escaping (serde_json
//!   would leave U+0085, U+2028 and U+2029 as they are, which libyaml reads as line breaks, and
//!   C1 control characters, which libyaml refuses), so no value can end the string, start a
//!   comment, or break a line.
//!
//! serde then reads the rewritten text once, as it reads any other. The rewritten scalar keeps
//! the line breaks its span covered (as escaped line breaks inside the quotes, which read as
//! nothing), so every line keeps its number; columns after a rewritten scalar on its line move,
//! and [`Interpolated::restore`] moves them back, so errors point into the file as written.
//! A file with no `${` at all is never walked: [`super::Config::parse`] checks that first.
//!
//! Keys are scalars too, and are expanded the same way. A scalar with an anchor or a tag
//! (`&a ${X}`, `!!str ${X}`) is refused rather than rewritten: its span starts at the anchor,
//! which would be lost. In a flow collection (`[…]`, `{…}`) a `{` ends a plain scalar, so
//! libyaml does not read `[${X}]` as a scalar holding `${X}`; such scalars are put between
//! quotes first, and then expanded as the plain scalars they were meant to be (see
//! [`quote_flow_plains`]), so `windows: [{limit: ${N}, …}]` works as in block style.
//!
//! # Secrets
//!
//! Values from the environment are typically credentials. They are never written into an
//! error by this module, and [`Interpolated::restore`] replaces any occurrence of one in a
//! later error (say, a header value that does not parse, echoed by its field type) with the
//! `${NAME}` it came from. Defaults are not secret: they are in the file. A value of fewer
//! than four bytes is replaced only where it stands alone, so that `LIMIT=1` does not turn
//! every `1` of every message into `${LIMIT}`; sequence indices in paths are left alone.

use std::borrow::Cow;
use std::env::VarError;
use std::fmt::Write as _;
use std::ops::Range;

use super::position::{for_each_event, Event, Style, Walk};
use super::ConfigError;

/// How a variable is looked up: `std::env::var` in production, a map in tests.
pub(super) type Env<'a> = &'a dyn Fn(&str) -> Result<String, VarError>;

/// A mistake in a `${…}`: where, under which YAML path, and what.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Problem {
    pub(super) at: (usize, usize),
    pub(super) path: String,
    pub(super) message: String,
}

/// A document with its `${…}` replaced.
#[derive(Debug)]
pub(super) struct Interpolated<'a> {
    /// The text serde reads.
    pub(super) text: Cow<'a, str>,
    /// The mistakes found, placed in the file as written; when there is any, `text` is not
    /// worth reading.
    pub(super) problems: Vec<Problem>,
    /// The rewrites that led from the file to `text`, first one first.
    layers: Vec<Layer>,
    /// Every non-empty value taken from the environment, with its variable's name; longest
    /// value first.
    secrets: Vec<(String, String)>,
}

/// One rewrite of a text: which byte ranges were replaced, in document order.
#[derive(Debug, Default)]
struct Layer(Vec<Splice>);

#[derive(Debug)]
struct Splice {
    /// The bytes replaced, in the text before.
    from: Range<usize>,
    /// What replaced them, in the text after.
    to: Range<usize>,
    /// Whether `to` is `from` between quotes, byte for byte, so that a position inside one is
    /// a position inside the other.
    quoted_copy: bool,
}

impl Layer {
    /// Where byte `offset` of the text after was in the text before. A place inside a
    /// rewritten scalar is its start (or the same character, for a quoted copy).
    fn back(&self, offset: usize) -> usize {
        match self.0.iter().rev().find(|s| s.to.start <= offset) {
            None => offset,
            Some(s) if offset < s.to.end && s.quoted_copy => {
                s.from.start + (offset - s.to.start).saturating_sub(1).min(s.from.len())
            }
            Some(s) if offset < s.to.end => s.from.start,
            Some(s) => s.from.end + (offset - s.to.end),
        }
    }
}

/// Expands every `${…}` in the scalars of `text`.
pub(super) fn interpolate<'a>(text: &'a str, env: Env<'_>) -> Interpolated<'a> {
    let (quoted, unquoted, were_plain) = quote_flow_plains(text);
    let middle: &str = quoted.as_deref().unwrap_or(text);
    let mut out = String::new();
    let mut copied = 0;
    let mut layer = Layer::default();
    let mut secrets = Vec::new();
    // Found in `middle`: (line, byte offset, path, message).
    let mut found_at: Vec<(usize, usize, String, String)> = Vec::new();
    let mut walk = Walk::default();
    for_each_event(middle, |event, at| {
        let path = walk.event(&event, at);
        let Event::Scalar(scalar) = event else {
            return;
        };
        if !scalar.value.contains("${") {
            return;
        }
        let path = path.unwrap_or_else(|| ".".to_string());
        let span = scalar.span.clone();
        let Some(raw) = middle.get(span.clone()) else {
            return;
        };
        if scalar.decorated {
            found_at.push((
                at.0,
                span.start,
                path,
                "`${…}` in a scalar with an anchor or a tag is not supported".into(),
            ));
            return;
        }
        let mut found = Vec::new();
        let value = expand(&scalar.value, env, &mut found, &mut secrets);
        if !found.is_empty() {
            // Each mistake is shown at its own `${`: the nth `${` of the value is the nth of
            // the text as written, unless an escape (`\x24{`) wrote one; then at the scalar.
            let written: Vec<usize> = raw.match_indices("${").map(|(i, _)| i).collect();
            let count = scalar.value.matches("${").count();
            for (nth, message) in found {
                let (line, offset) = match written.get(nth) {
                    Some(&i) if written.len() == count => {
                        (at.0 + line_ends(&raw[..i]).count(), span.start + i)
                    }
                    _ => (at.0, span.start),
                };
                found_at.push((line, offset, path.clone(), message));
            }
            return;
        }
        let style = if were_plain.contains(&span) {
            Style::Plain
        } else {
            scalar.style
        };
        out.push_str(&middle[copied..span.start]);
        let start = out.len();
        render(&mut out, &value, style, raw, at.1);
        layer.0.push(Splice {
            from: span.clone(),
            to: start..out.len(),
            quoted_copy: false,
        });
        copied = span.end;
    });
    let problems = found_at
        .into_iter()
        .map(|(line, offset, path, message)| Problem {
            at: (line, column_at(text, unquoted.back(offset))),
            path,
            message,
        })
        .collect();
    secrets
        .sort_by(|a: &(String, String), b| b.0.len().cmp(&a.0.len()).then_with(|| a.0.cmp(&b.0)));
    secrets.dedup_by(|a, b| a.0 == b.0);
    let text = match (layer.0.is_empty(), quoted) {
        (true, None) => Cow::Borrowed(text),
        (true, Some(quoted)) => Cow::Owned(quoted),
        (false, quoted) => {
            out.push_str(&quoted.as_deref().unwrap_or(text)[copied..]);
            Cow::Owned(out)
        }
    };
    Interpolated {
        text,
        problems,
        layers: vec![unquoted, layer],
        secrets,
    }
}

/// In a flow collection (`[…]`, `{…}`) a `{` ends a plain scalar, so YAML does not read
/// `[${A}]` as a scalar holding `${A}`: libyaml sees a scalar `$` and then a mapping (and then,
/// mostly, a syntax error). Each such scalar is first put between double quotes, as written,
/// and remembered as plain, so that the main pass expands it like any plain scalar
/// (`limit: ${N}` still a number). libyaml stops at the first one, so the text is read again
/// after each; each reading goes further, and stops at the next.
///
/// Returns the text with those scalars quoted (`None`: there were none), the rewrite, and the
/// quoted scalars' spans in that text.
fn quote_flow_plains(text: &str) -> (Option<String>, Layer, Vec<Range<usize>>) {
    let mut current: Option<String> = None;
    let mut layer = Layer::default();
    let mut spans = Vec::new();
    // Each round quotes one `${`, at least.
    for _ in 0..=text.matches("${").count() {
        let now: &str = current.as_deref().unwrap_or(text);
        let mut broken = None;
        for_each_event(now, |event, _| {
            if let Event::Scalar(scalar) = event {
                if broken.is_none()
                    && scalar.style == Style::Plain
                    && !scalar.decorated
                    && scalar.value.ends_with('$')
                    && now
                        .get(scalar.span.end..)
                        .is_some_and(|t| t.starts_with('{'))
                {
                    broken = Some(scalar.span.start);
                }
            }
        });
        let Some(start) = broken else {
            break;
        };
        let end = flow_plain_end(now, start);
        let written = &now[start..end];
        let mut quoted = String::with_capacity(written.len() + 2);
        double_quote(&mut quoted, written);
        let shift: isize = layer
            .0
            .iter()
            .map(|s| s.to.len() as isize - s.from.len() as isize)
            .sum();
        let from = (start as isize - shift) as usize..(end as isize - shift) as usize;
        let to = start..start + quoted.len();
        layer.0.push(Splice {
            from,
            to: to.clone(),
            quoted_copy: quoted.len() == written.len() + 2,
        });
        spans.push(to);
        let mut next = String::with_capacity(now.len() + quoted.len());
        next.push_str(&now[..start]);
        next.push_str(&quoted);
        next.push_str(&now[end..]);
        current = Some(next);
    }
    (current, layer, spans)
}

/// Where a plain scalar in a flow collection that starts at `start` ends, when its `${…}` are
/// read as part of it: at a flow indicator, `: `, ` #` or the end of the line, whichever
/// comes first outside `${…}`, less trailing blanks.
fn flow_plain_end(text: &str, start: usize) -> usize {
    let b = text.as_bytes();
    let mut i = start;
    while i < b.len() {
        match b[i] {
            b'$' if b.get(i + 1) == Some(&b'{') => {
                match text[i..].find(['}', '\n', '\r', '\u{85}', '\u{2028}', '\u{2029}']) {
                    Some(close) if b[i + close] == b'}' => i += close + 1,
                    // Unterminated: the expansion says so.
                    Some(close) => i += close,
                    None => i = b.len(),
                }
            }
            b',' | b'[' | b']' | b'{' | b'}' | b'\n' | b'\r' => break,
            // NEL, LS and PS, which end a line too.
            0xC2 if b.get(i + 1) == Some(&0x85) => break,
            0xE2 if b.get(i + 1) == Some(&0x80) && matches!(b.get(i + 2), Some(0xA8 | 0xA9)) => {
                break
            }
            b':' if matches!(
                b.get(i + 1),
                None | Some(b' ' | b'\t' | b'\n' | b'\r' | b',' | b'[' | b']' | b'{' | b'}')
            ) =>
            {
                break
            }
            b'#' if i > start && matches!(b[i - 1], b' ' | b'\t') => break,
            _ => i += 1,
        }
    }
    while i > start && matches!(b[i - 1], b' ' | b'\t') {
        i -= 1;
    }
    i
}

/// `value` with its `${…}` expanded. Each mistake is added to `found` with the index of its
/// `${` among those of `value` (an escape's counts); each non-empty value read to `secrets`.
fn expand(
    value: &str,
    env: Env<'_>,
    found: &mut Vec<(usize, String)>,
    secrets: &mut Vec<(String, String)>,
) -> String {
    let mut out = String::with_capacity(value.len());
    let mut rest = value;
    let mut nth = 0;
    while let Some(i) = rest.find("${") {
        let this = nth;
        nth += 1;
        if rest[..i].ends_with('$') {
            // `$${`: a literal `${`.
            out.push_str(&rest[..i - 1]);
            out.push_str("${");
            rest = &rest[i + 2..];
            continue;
        }
        out.push_str(&rest[..i]);
        let after = &rest[i + 2..];
        let Some(close) = after.find('}') else {
            found.push((
                this,
                "unterminated `${`: write `${NAME}`, or `$${` for a literal `${`".into(),
            ));
            return out;
        };
        let inside = &after[..close];
        rest = &after[close + 1..];
        let (name, default) = match inside.split_once(":-") {
            Some((name, default)) => (name, Some(default)),
            None => (inside, None),
        };
        if let Some(default) = default {
            let nested = default.matches("${").count();
            if nested > 0 {
                nth += nested;
                found.push((
                    this,
                    format!("`${{{inside}}}`: a default cannot hold a `${{`"),
                ));
                continue;
            }
        }
        if !is_name(name) {
            found.push((
                this,
                format!(
                    "`${{{inside}}}` is not `${{NAME}}` or `${{NAME:-default}}` with NAME made of letters, digits and '_', not starting with a digit (write `$${{` for a literal `${{`)"
                ),
            ));
            continue;
        }
        match (env(name), default) {
            (Ok(v), Some(default)) if v.is_empty() => out.push_str(default),
            (Ok(v), _) => {
                out.push_str(&v);
                if !v.is_empty() {
                    secrets.push((v, name.to_string()));
                }
            }
            (Err(VarError::NotPresent), Some(default)) => out.push_str(default),
            (Err(VarError::NotPresent), None) => found.push((
                this,
                format!(
                    "environment variable {name} is not set (write `${{{name}:-default}}` for a default)"
                ),
            )),
            (Err(VarError::NotUnicode(_)), _) => found.push((
                this,
                format!("environment variable {name} is not valid UTF-8"),
            )),
        }
    }
    out.push_str(rest);
    out
}

/// `[A-Za-z_][A-Za-z0-9_]*`
fn is_name(name: &str) -> bool {
    let mut bytes = name.bytes();
    bytes
        .next()
        .is_some_and(|b| b.is_ascii_alphabetic() || b == b'_')
        && bytes.all(|b| b.is_ascii_alphanumeric() || b == b'_')
}

/// Whether `value`, written as a plain scalar, reads back as itself and nothing else: no
/// indicator, no space, no `:` or `#`, no flow punctuation, not a document marker.
fn is_plain_word(value: &str) -> bool {
    !value.is_empty()
        && value
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"_./+-".contains(&b))
        && value != "-"
        && !value.starts_with("---")
        && !value.starts_with("...")
}

/// Writes `value` as a scalar that stands in for `raw`, written in `style` at 1-based
/// `column`: one that reads back as `value` alone, and covers as many lines as `raw` did.
fn render(out: &mut String, value: &str, style: Style, raw: &str, column: usize) {
    let breaks = line_ends(raw).count();
    if style == Style::Plain && breaks == 0 && is_plain_word(value) {
        out.push_str(value);
        return;
    }
    // A block scalar's span ends after its last line break, and what follows on that line (the
    // indentation of the next node) must stay where it is.
    let tail = &raw[line_ends(raw).last().unwrap_or(0)..];
    let tail_is_blank = breaks > 0 && tail.bytes().all(|b| b == b' ' || b == b'\t');
    double_quote(out, value);
    out.pop();
    // An escaped line break inside double quotes reads as nothing; the indentation after it
    // is dropped too.
    for _ in 0..breaks - usize::from(tail_is_blank) {
        out.push_str("\\\n");
        out.extend(std::iter::repeat_n(' ', column));
    }
    out.push('"');
    if tail_is_blank {
        out.push('\n');
        out.push_str(tail);
    }
}

/// `value` as a double-quoted scalar: printable ASCII as it is, `"` and `\\` escaped, and
/// every other character escaped by its code point.
fn double_quote(out: &mut String, value: &str) {
    out.push('"');
    for c in value.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            ' '..='~' => out.push(c),
            '\n' => out.push_str("\\n"),
            '\t' => out.push_str("\\t"),
            '\r' => out.push_str("\\r"),
            c if u32::from(c) <= 0xFFFF => {
                let _ = write!(out, "\\u{:04X}", u32::from(c));
            }
            c => {
                let _ = write!(out, "\\U{:08X}", u32::from(c));
            }
        }
    }
    out.push('"');
}

/// The 1-based column, in characters, of byte `offset` of `text`.
fn column_at(text: &str, offset: usize) -> usize {
    let mut offset = offset.min(text.len());
    while !text.is_char_boundary(offset) {
        offset -= 1;
    }
    let start = line_ends(&text[..offset]).last().unwrap_or(0);
    text[start..offset].chars().count() + 1
}

/// The byte offset after each line break of `text`, lines broken as libyaml breaks them: at
/// CRLF, CR, LF, NEL, LS and PS.
fn line_ends(text: &str) -> impl Iterator<Item = usize> + '_ {
    let b = text.as_bytes();
    text.char_indices().filter_map(move |(i, c)| match c {
        '\r' if b.get(i + 1) == Some(&b'\n') => None,
        '\r' | '\n' | '\u{85}' | '\u{2028}' | '\u{2029}' => Some(i + c.len_utf8()),
        _ => None,
    })
}

impl Interpolated<'_> {
    /// `e`, found in the rewritten text, made to fit the file as written (`original`): its
    /// column put back where the file has it, and every environment value in its path or
    /// message replaced by the `${NAME}` it came from.
    pub(super) fn restore(&self, original: &str, mut e: ConfigError) -> ConfigError {
        if e.line > 0 && e.column > 0 {
            if let Some(offset) = offset_of(&self.text, e.line, e.column) {
                let back = self.layers.iter().rev().fold(offset, |o, l| l.back(o));
                e.column = column_at(original, back);
            }
        }
        e.message = self.scrub(&e.message);
        e.path = self.scrub_path(&e.path);
        e
    }

    /// `path` scrubbed as [`Self::scrub`] does, except for its sequence indices (`[0]`), which
    /// come from the file's shape, not from a value.
    fn scrub_path(&self, path: &str) -> String {
        let mut out = String::with_capacity(path.len());
        let mut rest = path;
        while let Some(open) = rest.find('[') {
            let close = rest[open..].find(']').map(|c| open + c);
            match close {
                Some(close) if rest[open + 1..close].bytes().all(|b| b.is_ascii_digit()) => {
                    out.push_str(&self.scrub(&rest[..open]));
                    out.push_str(&rest[open..=close]);
                    rest = &rest[close + 1..];
                }
                _ => break,
            }
        }
        out.push_str(&self.scrub(rest));
        out
    }

    /// `s` with each environment value in it replaced by `${NAME}`, longest value first, in
    /// one pass (so that a name put in is never scrubbed again). A value is also looked for in
    /// ASCII lower and upper case, and as `{:?}` would escape it, since messages quote strings
    /// that way.
    ///
    /// A value shorter than [`SHORT`] bytes is replaced only where it stands alone, not next to
    /// a letter or digit: `LIMIT=1` must not turn `u32` into `u3${LIMIT}`, and so short a value
    /// hides nothing anyway.
    fn scrub(&self, s: &str) -> String {
        if self.secrets.is_empty() {
            return s.to_string();
        }
        let mut forms: Vec<(String, &str)> = Vec::new();
        for (value, name) in &self.secrets {
            // Field types lowercase what they keep (hosts, URLs) and errors may quote that.
            for spelled in [
                value.clone(),
                value.to_ascii_lowercase(),
                value.to_ascii_uppercase(),
            ] {
                forms.push((spelled.escape_debug().to_string(), name));
                forms.push((spelled, name));
            }
        }
        forms.sort_by(|a, b| b.0.len().cmp(&a.0.len()).then_with(|| a.0.cmp(&b.0)));
        forms.dedup_by(|a, b| a.0 == b.0);
        let alnum = |c: Option<char>| c.is_some_and(char::is_alphanumeric);
        let mut out = String::with_capacity(s.len());
        let mut rest = s;
        let mut before = None;
        'outer: while let Some(c) = rest.chars().next() {
            for (form, name) in &forms {
                if let Some(after) = rest.strip_prefix(form.as_str()) {
                    if form.len() < SHORT && (alnum(before) || alnum(after.chars().next())) {
                        continue;
                    }
                    let _ = write!(out, "${{{name}}}");
                    before = form.chars().last();
                    rest = after;
                    continue 'outer;
                }
            }
            out.push(c);
            before = Some(c);
            rest = &rest[c.len_utf8()..];
        }
        out
    }
}

/// Values shorter than this are scrubbed only where they stand alone (see
/// [`Interpolated::scrub`]).
const SHORT: usize = 4;

/// The byte offset of 1-based `line` and `column` (counted in characters, as libyaml does)
/// in `text`, lines broken as libyaml breaks them.
fn offset_of(text: &str, line: usize, column: usize) -> Option<usize> {
    let start = if line == 1 {
        0
    } else {
        line_ends(text).nth(line - 2)?
    };
    let rest = &text[start..];
    match rest.char_indices().nth(column - 1) {
        Some((i, _)) => Some(start + i),
        None if rest.chars().count() == column - 1 => Some(text.len()),
        None => None,
    }
}

#[cfg(test)]
mod tests;
