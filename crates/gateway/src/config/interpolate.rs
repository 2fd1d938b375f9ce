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
//! `[${X}]` is not YAML for a scalar holding `${X}` (libyaml stops at the `{`); that case is
//! recognized and the error says to quote it, or, for a number, to use block style: a quoted
//! scalar is a string, and stays one.
//!
//! # Secrets
//!
//! Values from the environment are typically credentials. They are never written into an
//! error by this module, and [`Interpolated::restore`] replaces any occurrence of one in a
//! later error (say, a header value that does not parse, echoed by its field type) with the
//! `${NAME}` it came from. Defaults are not secret: they are in the file.

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
    /// The mistakes found; when there is any, `text` is not worth reading.
    pub(super) problems: Vec<Problem>,
    /// Each rewritten scalar: its bytes in the file, and in `text`. In document order.
    splices: Vec<(Range<usize>, Range<usize>)>,
    /// Every non-empty value taken from the environment, with its variable's name; longest
    /// value first.
    secrets: Vec<(String, String)>,
}

/// Expands every `${…}` in the scalars of `text`.
pub(super) fn interpolate<'a>(text: &'a str, env: Env<'_>) -> Interpolated<'a> {
    let mut out = String::new();
    let mut copied = 0;
    let mut splices = Vec::new();
    let mut secrets = Vec::new();
    let mut problems = Vec::new();
    let mut walk = Walk::default();
    for_each_event(text, |event, at| {
        let path = walk.event(&event, at);
        let Event::Scalar(scalar) = event else {
            return;
        };
        let path = path.unwrap_or_else(|| ".".to_string());
        let span = scalar.span.clone();
        let Some(raw) = text.get(span.clone()) else {
            return;
        };
        if scalar.style == Style::Plain
            && scalar.value.ends_with('$')
            && text.get(span.end..).is_some_and(|t| t.starts_with('{'))
        {
            problems.push(Problem {
                at,
                path: path.clone(),
                message: "in a flow collection ([…] or {…}) a `${` must be quoted, as in \"${NAME}\", which makes the value a string; for a number or a boolean write it in block style, `key: ${NAME}` on a line of its own"
                    .into(),
            });
            return;
        }
        if !scalar.value.contains("${") {
            return;
        }
        if scalar.decorated {
            problems.push(Problem {
                at,
                path,
                message: "`${…}` in a scalar with an anchor or a tag is not supported".into(),
            });
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
                let at = match written.get(nth) {
                    Some(&offset) if written.len() == count => advance(at, &raw[..offset]),
                    _ => at,
                };
                problems.push(Problem {
                    at,
                    path: path.clone(),
                    message,
                });
            }
            return;
        }
        out.push_str(&text[copied..span.start]);
        let start = out.len();
        render(&mut out, &value, scalar.style, raw, at.1);
        splices.push((span.clone(), start..out.len()));
        copied = span.end;
    });
    secrets
        .sort_by(|a: &(String, String), b| b.0.len().cmp(&a.0.len()).then_with(|| a.0.cmp(&b.0)));
    secrets.dedup_by(|a, b| a.0 == b.0);
    let text = if splices.is_empty() {
        Cow::Borrowed(text)
    } else {
        out.push_str(&text[copied..]);
        Cow::Owned(out)
    };
    Interpolated {
        text,
        problems,
        splices,
        secrets,
    }
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
    let breaks = raw.matches('\n').count();
    if style == Style::Plain && breaks == 0 && is_plain_word(value) {
        out.push_str(value);
        return;
    }
    // A block scalar's span ends after its last line break, and what follows on that line (the
    // indentation of the next node) must stay where it is.
    let tail = raw.rsplit('\n').next().unwrap_or("");
    let tail_is_blank = breaks > 0 && tail.bytes().all(|b| b == b' ' || b == b'\t');
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

/// The 1-based line and column reached from `at` by reading `text`.
fn advance(at: (usize, usize), text: &str) -> (usize, usize) {
    text.chars().fold(at, |(line, column), c| match c {
        '\n' => (line + 1, 1),
        _ => (line, column + 1),
    })
}

impl Interpolated<'_> {
    /// `e`, found in the rewritten text, made to fit the file as written (`original`): its
    /// column put back where the file has it, and every environment value in its path or
    /// message replaced by the `${NAME}` it came from.
    pub(super) fn restore(&self, original: &str, mut e: ConfigError) -> ConfigError {
        if e.line > 0 && e.column > 0 {
            if let Some(offset) = offset_of(&self.text, e.line, e.column) {
                let back = match self.splices.iter().rev().find(|(_, to)| to.start <= offset) {
                    None => offset,
                    Some((from, to)) if offset < to.end => from.start,
                    Some((from, to)) => from.end + (offset - to.end),
                };
                if let Some(start) = original
                    .get(..back)
                    .map(|s| s.rfind('\n').map_or(0, |i| i + 1))
                {
                    e.column = original[start..back].chars().count() + 1;
                }
            }
        }
        e.message = self.scrub(&e.message);
        e.path = self.scrub(&e.path);
        e
    }

    /// `s` with each environment value in it replaced by `${NAME}`, longest value first, in
    /// one pass (so that a name put in is never scrubbed again). A value is also looked for as
    /// `{:?}` would escape it, since messages quote strings that way.
    fn scrub(&self, s: &str) -> String {
        if self.secrets.is_empty() {
            return s.to_string();
        }
        let mut forms: Vec<(String, &str)> = Vec::new();
        for (value, name) in &self.secrets {
            forms.push((value.clone(), name));
            let escaped = value.escape_debug().to_string();
            if escaped != *value {
                forms.push((escaped, name));
            }
        }
        forms.sort_by_key(|f| std::cmp::Reverse(f.0.len()));
        let mut out = String::with_capacity(s.len());
        let mut rest = s;
        'outer: while let Some(c) = rest.chars().next() {
            for (form, name) in &forms {
                if let Some(after) = rest.strip_prefix(form.as_str()) {
                    let _ = write!(out, "${{{name}}}");
                    rest = after;
                    continue 'outer;
                }
            }
            out.push(c);
            rest = &rest[c.len_utf8()..];
        }
        out
    }
}

/// The byte offset of 1-based `line` and `column` (counted in characters, as libyaml does)
/// in `text`; lines end at `\n`.
fn offset_of(text: &str, line: usize, column: usize) -> Option<usize> {
    let start = if line == 1 {
        0
    } else {
        text.match_indices('\n').nth(line - 2)?.0 + 1
    };
    let rest = &text[start..];
    match rest.char_indices().nth(column - 1) {
        Some((i, _)) => Some(start + i),
        None if rest.chars().count() == column - 1 => Some(text.len()),
        None => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    /// `text` interpolated from `vars`; the text, or the problems as `LINE:COL: PATH: message`.
    fn run(text: &str, vars: &[(&str, &str)]) -> Result<String, Vec<String>> {
        let vars: HashMap<String, String> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        let env = |name: &str| vars.get(name).cloned().ok_or(VarError::NotPresent);
        let done = interpolate(text, &env);
        if done.problems.is_empty() {
            Ok(done.text.into_owned())
        } else {
            Err(done
                .problems
                .iter()
                .map(|p| format!("{}:{}: {}: {}", p.at.0, p.at.1, p.path, p.message))
                .collect())
        }
    }

    /// The YAML value of `text` once interpolated.
    fn value(text: &str, vars: &[(&str, &str)]) -> serde_yaml::Value {
        let done = run(text, vars).unwrap_or_else(|e| panic!("{e:#?}"));
        serde_yaml::from_str(&done).unwrap_or_else(|e| panic!("{e}\n{done}"))
    }

    fn yaml(text: &str) -> serde_yaml::Value {
        serde_yaml::from_str(text).unwrap()
    }

    #[test]
    fn a_text_without_variables_is_not_copied() {
        let text = "a: 1 # ${ in a comment\nb: $x\n";
        let env = |_: &str| -> Result<String, VarError> { panic!("nothing to look up") };
        let done = interpolate(text, &env);
        assert!(matches!(done.text, Cow::Borrowed(_)));
        assert!(done.problems.is_empty());
    }

    #[test]
    fn variables_defaults_and_escapes() {
        let vars = [("A", "alpha"), ("EMPTY", ""), ("B", "beta")];
        assert_eq!(
            value(
                "x: ${A}\ny: ${UNSET:-fallback}\nz: ${EMPTY:-used when empty}\nw: '${EMPTY}'\n",
                &vars
            ),
            yaml("x: alpha\ny: fallback\nz: used when empty\nw: ''\n")
        );
        assert_eq!(
            value("x: \"$${A} is ${A}, $$${A}, $5 and $ {A}\"\n", &vars),
            yaml("x: \"${A} is alpha, $${A}, $5 and $ {A}\"\n")
        );
        assert_eq!(
            value(
                "x: ${A}-${B}/${A}\ny: \"${UNSET:-}\"\nz: ${UNSET:-}\n",
                &vars
            ),
            yaml("x: alpha-beta/alpha\ny: ''\nz: ''\n")
        );
    }

    #[test]
    fn every_style_and_flow_collections() {
        let vars = [("H", "a.test"), ("K", "s3cret")];
        let text = "hosts: [\"${H}\", '${H}:81', x]\nh: { Authorization: \"Bearer ${K}\" }\nl: |\n  ${K}\n  two\nf: >-\n  ${K}\n  folded\nend: ${H}\n";
        assert_eq!(
            value(text, &vars),
            yaml("hosts: [a.test, 'a.test:81', x]\nh: {Authorization: Bearer s3cret}\nl: \"s3cret\\ntwo\\n\"\nf: s3cret folded\nend: a.test\n")
        );
        // Every line keeps its number.
        let done = run(text, &vars).unwrap();
        assert_eq!(done.lines().count(), text.lines().count(), "{done}");
        assert!(done.lines().last().unwrap().starts_with("end: "), "{done}");
    }

    #[test]
    fn a_plain_number_stays_a_number() {
        assert_eq!(
            value(
                "limit: ${L}\nflag: ${F}\nneg: ${N}\nword: ${W}\n",
                &[("L", "60"), ("F", "true"), ("N", "-3"), ("W", "a b")]
            ),
            yaml("limit: 60\nflag: true\nneg: -3\nword: a b\n")
        );
        // Quoted, it is a string.
        assert_eq!(
            value("limit: \"${L}\"\n", &[("L", "60")]),
            yaml("limit: \"60\"\n")
        );
    }

    #[test]
    fn a_value_cannot_change_the_document() {
        for evil in [
            "x\nadmin: {listen: 0.0.0.0:9901}",
            "x\" \nadmin: 1 #",
            "a: b",
            "# comment",
            "[1, 2]",
            "- item",
            "'quoted'",
            "--- ",
            "|",
            "&anchor *alias !tag",
            "\u{85}\u{2028}\u{2029}\u{feff}\u{1}\u{9f}\\\t\r\"",
            "${OTHER}",
        ] {
            let vars = [("EVIL", evil), ("OTHER", "other")];
            for text in [
                "k: ${EVIL}\nnext: 1\n",
                "k: \"${EVIL}\"\nnext: 1\n",
                "k: '${EVIL}'\nnext: 1\n",
                "k: [\"${EVIL}\", 2]\nnext: 1\n",
                "k: |\n  ${EVIL}\nnext: 1\n",
                "k:\n  - ${EVIL}\n  - x\nnext: 1\n",
            ] {
                let got = value(text, &vars);
                let k = &got["k"];
                let s = k
                    .as_str()
                    .or_else(|| k[0].as_str())
                    .unwrap_or_else(|| panic!("{text:?} with {evil:?}: {got:?}"));
                let expected = if text.contains('|') {
                    format!("{evil}\n")
                } else {
                    evil.to_string()
                };
                assert_eq!(s, expected, "{text:?}");
                assert_eq!(got["next"], yaml("1"), "{text:?} with {evil:?}: {got:?}");
                assert_eq!(got.as_mapping().unwrap().len(), 2, "{got:?}");
            }
        }
    }

    #[test]
    fn multi_line_scalars_keep_the_lines_after_them() {
        let vars = [("A", "alpha")];
        for text in [
            "a:\n  b: \"one ${A}\n    two\"\n  c: 1\n",
            "a:\n  b: one ${A}\n    two\n  c: 1\n",
            "a:\n  b: |\n    ${A}\n\n  c: 1\n",
            "a:\n  b: >\n    ${A}\n    two\n  c: 1\n",
            "a:\n  b: |\n    ${A}",
        ] {
            let done = run(text, &vars).unwrap();
            assert_eq!(
                done.lines().count(),
                text.lines().count(),
                "{text:?} -> {done:?}"
            );
            let v: serde_yaml::Value = serde_yaml::from_str(&done).unwrap();
            assert!(v["a"]["b"].as_str().unwrap().contains("alpha"), "{v:?}");
            if text.contains("c: 1") {
                assert_eq!(v["a"]["c"], yaml("1"), "{done:?}");
                assert!(done.lines().any(|l| l == "  c: 1"), "{done:?}");
            }
        }
    }

    #[test]
    fn a_block_scalar_becomes_one_quoted_line_and_escaped_breaks() {
        let text = "a:\n  b: |\n    ${A}\n\n  c: 1\n";
        assert_eq!(
            run(text, &[("A", "al\"pha")]).unwrap(),
            "a:\n  b: \"al\\\"pha\\n\\\n      \\\n      \"\n  c: 1\n"
        );
    }

    #[test]
    fn keys_are_interpolated_too() {
        assert_eq!(
            value("h: {\"${N}\": v}\n${N}: w\n", &[("N", "X-Key")]),
            yaml("h: {X-Key: v}\nX-Key: w\n")
        );
    }

    #[test]
    fn each_mistake_is_shown_at_its_dollar_with_its_path() {
        let text = "a:\n  - x: \"ok ${SET} ${NOPE} and ${ALSO_NOT}\"\n  - ${BAD NAME}\n  - ${1X}\n  - \"${OPEN\"\nb: |\n  fine\n  ${NOPE:-${SET}}\n";
        assert_eq!(
            run(text, &[("SET", "v")]).unwrap_err(),
            [
                "2:19: a[0].x: environment variable NOPE is not set (write `${NOPE:-default}` for a default)",
                "2:31: a[0].x: environment variable ALSO_NOT is not set (write `${ALSO_NOT:-default}` for a default)",
                "3:5: a[1]: `${BAD NAME}` is not `${NAME}` or `${NAME:-default}` with NAME made of letters, digits and '_', not starting with a digit (write `$${` for a literal `${`)",
                "4:5: a[2]: `${1X}` is not `${NAME}` or `${NAME:-default}` with NAME made of letters, digits and '_', not starting with a digit (write `$${` for a literal `${`)",
                "5:6: a[3]: unterminated `${`: write `${NAME}`, or `$${` for a literal `${`",
                "8:3: b: `${NOPE:-${SET}`: a default cannot hold a `${`",
            ]
        );
    }

    #[test]
    fn unquoted_in_a_flow_collection_and_anchors_are_refused() {
        assert_eq!(
            run("a: [${X}]\n", &[("X", "x")]).unwrap_err(),
            ["1:5: a[0]: in a flow collection ([…] or {…}) a `${` must be quoted, as in \"${NAME}\", which makes the value a string; for a number or a boolean write it in block style, `key: ${NAME}` on a line of its own"]
        );
        assert_eq!(
            run("a: &x \"${X}\"\nb: !!str ${X}\n", &[("X", "x")]).unwrap_err(),
            [
                "1:4: a: `${…}` in a scalar with an anchor or a tag is not supported",
                "2:4: b: `${…}` in a scalar with an anchor or a tag is not supported",
            ]
        );
    }

    #[test]
    fn errors_are_put_back_in_the_file_and_scrubbed() {
        let text = "a: [\"${K}\", '${K}', bad]\n";
        let vars: HashMap<&str, &str> = [("K", "se\"cret"), ("K2", "se")].into();
        let env = |n: &str| {
            vars.get(n)
                .map(|v| v.to_string())
                .ok_or(VarError::NotPresent)
        };
        let done = interpolate(text, &env);
        assert!(done.problems.is_empty());
        // `bad` is at 1:21 in the file; the rewritten text has it further right.
        let in_text = done.text.find("bad").unwrap() + 1;
        assert_ne!(in_text, 21);
        let e = ConfigError {
            file: "t.yaml".into(),
            line: 1,
            column: in_text,
            path: "a[2]".into(),
            message: "\"se\\\"cret\" or se\"cret, not bad".into(),
        };
        let e = done.restore(text, e);
        assert_eq!(e.column, 21);
        assert_eq!(e.message, "\"${K}\" or ${K}, not bad");
        // A position inside a rewritten scalar goes to its start.
        let inside = ConfigError {
            column: done.text.find("cret").unwrap() + 1,
            ..e.clone()
        };
        assert_eq!(done.restore(text, inside).column, 5);
    }

    #[test]
    fn scrubbing_is_longest_first_and_one_pass() {
        let env = |n: &str| match n {
            "LONG" => Ok("abcdef".to_string()),
            "SHORT" => Ok("abc".to_string()),
            "N" => Ok("N".to_string()),
            _ => Err(VarError::NotPresent),
        };
        let done = interpolate("a: \"${LONG} ${SHORT} ${N}\"\n", &env);
        assert_eq!(
            done.scrub("abcdef abc abcd N"),
            "${LONG} ${SHORT} ${SHORT}d ${N}"
        );
    }
}
