//! Property tests of `Config::parse` on broken input: whatever the bytes, parsing
//! never panics, and every mistake reads `FILE:LINE:COL: PATH: message` on one line, with LINE
//! and COL inside the file.
//!
//! Proptest's default case count runs in CI; `scripts/fuzz-long` runs many more. The truncation
//! test is exhaustive (every offset of each base config) and always runs in full.

use proptest::prelude::*;

use super::*;

/// Valid configs the mutations start from: the embedded default, the demo config (comments,
/// quotas, several routes) and a compact one with flow style and every selection.
const SMALL: &str = r#"listen: ["127.0.0.1:8080", "127.0.0.1:8081"]
threads: 2
admin: { listen: "127.0.0.1:9901", token_env: SLUICE_TOKEN }
state: { backend: memory }
routes:
  - name: a
    match: { hosts: ["a.test", "*.a.test"], path_prefix: /v1/, methods: [GET, post] }
    upstream:
      members: [{ url: "http://127.0.0.1:9001", weight: 3 }, { url: "https://127.0.0.1:9002" }]
      retries: 1
    quota:
      key: "header:X-Tenant"
      windows: [{ name: s, limit: 10, window: 1s }, { name: d, limit: 1000, window: 1d }]
      cost: { default: 2, rules: [{ path_prefix: /v1/search, methods: [GET], cost: 5 }] }
      on_store_error: closed
  - name: b
    match: { hosts: ["*"] }
    upstream:
      selection: least_used
      on_restore: min
      members: []
"#;

fn bases() -> [&'static str; 3] {
    [
        EMBEDDED_DEFAULT,
        include_str!("../../../configs/demo.yaml"),
        SMALL,
    ]
}

/// Parses `text` as `t.yaml` and checks the shape of what comes back. Returns the number of
/// routes of an accepted config.
fn parse_checked(text: &str) -> Result<Option<usize>, TestCaseError> {
    let errors = match Config::parse("t.yaml", text) {
        Ok(config) => return Ok(Some(config.routes.len())),
        Err(errors) => errors,
    };
    prop_assert!(!errors.0.is_empty(), "an error without a mistake");
    // Lines as YAML counts them (and as libyaml reports them): a lone CR, CRLF, NEL, LS and PS
    // end a line too, not only LF.
    let yaml_lines = text
        .replace("\r\n", "\n")
        .replace(['\r', '\u{85}', '\u{2028}', '\u{2029}'], "\n");
    let lines: Vec<&str> = yaml_lines.split('\n').collect();
    let printed = errors.to_string();
    prop_assert_eq!(
        printed.lines().count(),
        errors.0.len(),
        "one line per mistake:\n{}",
        printed
    );
    for (e, line) in errors.0.iter().zip(printed.lines()) {
        // LINE is 1-based and names a line of the file (one past the last newline is where an
        // unexpected end of the file is found); COL is 1-based and at most one past its end.
        // That holds at the end of a file without a final newline too, where libyaml itself
        // reports the start of the line after the last (see the test at the end).
        prop_assert!(
            (1..=lines.len()).contains(&e.line),
            "line {} outside 1..={}: {}\n--- input ---\n{}",
            e.line,
            lines.len(),
            line,
            text
        );
        let width = lines[e.line - 1].chars().count();
        prop_assert!(
            (1..=width + 1).contains(&e.column),
            "column {} outside 1..={}: {}\n--- input ---\n{}",
            e.column,
            width + 1,
            line,
            text
        );
        continue_shape(e, line)?;
    }
    Ok(None)
}

/// The printed line of `e`, taken apart the way a reader (or an editor) would.
fn continue_shape(e: &ConfigError, line: &str) -> Result<(), TestCaseError> {
    let rest = line.strip_prefix("t.yaml:");
    prop_assert!(rest.is_some(), "{}", line);
    let mut parts = rest.unwrap().splitn(3, ':');
    let (line_no, column_no) = (e.line.to_string(), e.column.to_string());
    prop_assert_eq!(parts.next(), Some(line_no.as_str()), "{}", line);
    prop_assert_eq!(parts.next(), Some(column_no.as_str()), "{}", line);
    let tail = parts.next().unwrap_or_default();
    let mut message = String::new();
    crate::write_one_line(&mut message, &e.message).unwrap();
    let expected = format!(" {}: {}", e.path, message);
    prop_assert_eq!(tail, expected.as_str());
    // PATH may be empty: the path of a key written `""` (or `!!str`) is the empty string.
    prop_assert!(!e.message.is_empty(), "{}", line);
    Ok(())
}

/// Pieces of YAML, valid and broken, to string together.
fn yamlish() -> impl Strategy<Value = String> {
    let token = prop_oneof![
        Just("routes:"),
        Just("listen:"),
        Just("admin:"),
        Just("state:"),
        Just("  - name: a"),
        Just("    match:"),
        Just("      hosts: [\"a.test\"]"),
        Just("    upstream:"),
        Just("      members:"),
        Just("        - url: \"http://127.0.0.1:1\""),
        Just("    quota:"),
        Just("      windows: [{ name: w, limit: 1, window: 1s }]"),
        Just("\n"),
        Just("\n"),
        Just("  "),
        Just("\t"),
        Just("- "),
        Just(": "),
        Just("["),
        Just("]"),
        Just("{"),
        Just("}"),
        Just(","),
        Just("'"),
        Just("\""),
        Just("# c"),
        Just("&x "),
        Just("*x"),
        Just("!!str "),
        Just("<<: *x"),
        Just("~"),
        Just("0"),
        Just("-1"),
        Just("1e400"),
        Just("1s"),
        Just("0ms"),
        Just("é"),
        Just("\u{feff}"),
        Just("---"),
        Just("..."),
        Just("%YAML 1.1"),
        Just("? "),
        Just("|"),
        Just(">-"),
    ];
    prop::collection::vec(token, 0..40).prop_map(|t| t.concat())
}

/// Line-level mutations of a valid config.
#[derive(Debug, Clone)]
enum Mutation {
    Delete(usize),
    Duplicate(usize),
    /// Swap the values (after `: `) of two lines.
    SwapValues(usize, usize),
    /// Swap two lines.
    SwapLines(usize, usize),
    Indent(usize),
    Dedent(usize),
    /// Replace one byte (at a char boundary) with a printable ASCII byte.
    Byte(usize, u8),
}

fn mutation() -> impl Strategy<Value = Mutation> {
    let i = any::<prop::sample::Index>();
    prop_oneof![
        i.clone()
            .prop_map(|i| Mutation::Delete(i.index(usize::MAX))),
        i.clone()
            .prop_map(|i| Mutation::Duplicate(i.index(usize::MAX))),
        (i.clone(), i.clone())
            .prop_map(|(a, b)| Mutation::SwapValues(a.index(usize::MAX), b.index(usize::MAX))),
        (i.clone(), i.clone())
            .prop_map(|(a, b)| Mutation::SwapLines(a.index(usize::MAX), b.index(usize::MAX))),
        i.clone()
            .prop_map(|i| Mutation::Indent(i.index(usize::MAX))),
        i.clone()
            .prop_map(|i| Mutation::Dedent(i.index(usize::MAX))),
        (i, 0x20u8..0x7f).prop_map(|(i, b)| Mutation::Byte(i.index(usize::MAX), b)),
    ]
}

fn mutate(text: &str, mutations: &[Mutation]) -> String {
    let mut lines: Vec<String> = text.lines().map(str::to_string).collect();
    for m in mutations {
        if lines.is_empty() {
            break;
        }
        let n = lines.len();
        match *m {
            Mutation::Delete(i) => {
                lines.remove(i % n);
            }
            Mutation::Duplicate(i) => {
                let line = lines[i % n].clone();
                lines.insert(i % n, line);
            }
            Mutation::SwapValues(a, b) => {
                let split = |l: &str| {
                    l.split_once(": ")
                        .map(|(k, v)| (k.to_string(), v.to_string()))
                };
                if let (Some((ka, va)), Some((kb, vb))) =
                    (split(&lines[a % n]), split(&lines[b % n]))
                {
                    lines[a % n] = format!("{ka}: {vb}");
                    lines[b % n] = format!("{kb}: {va}");
                }
            }
            Mutation::SwapLines(a, b) => lines.swap(a % n, b % n),
            Mutation::Indent(i) => lines[i % n].insert_str(0, "  "),
            Mutation::Dedent(i) => {
                let l = &mut lines[i % n];
                let cut = l.len() - l.trim_start().len();
                l.drain(..cut.min(2));
            }
            Mutation::Byte(i, b) => {
                let l = &mut lines[i % n];
                if !l.is_empty() {
                    let mut at = i % l.len();
                    while !l.is_char_boundary(at) {
                        at -= 1;
                    }
                    let end = at + l[at..].chars().next().map_or(0, char::len_utf8);
                    l.replace_range(at..end, &char::from(b).to_string());
                }
            }
        }
    }
    let mut out = lines.join("\n");
    out.push('\n');
    out
}

#[test]
fn the_bases_are_valid() {
    for base in bases() {
        Config::parse("t.yaml", base).unwrap_or_else(|e| panic!("{e}"));
    }
}

/// A config cut short anywhere (a write caught half way) is refused, or is a config with at
/// most the original's routes. Every offset of every base.
#[test]
fn every_truncation_is_refused_or_has_at_most_the_routes() {
    for base in bases() {
        let full = Config::parse("t.yaml", base).unwrap().routes.len();
        for end in (0..=base.len()).filter(|&i| base.is_char_boundary(i)) {
            let cut = &base[..end];
            match parse_checked(cut) {
                Ok(Some(routes)) => assert!(
                    routes <= full,
                    "{routes} routes from the first {end} bytes, {full} in the whole"
                ),
                Ok(None) => {}
                Err(e) => panic!("cut at {end}: {e}"),
            }
        }
    }
}

proptest! {
    #[test]
    fn random_bytes_never_panic_and_errors_are_well_formed(
        bytes in prop::collection::vec(any::<u8>(), 0..200),
    ) {
        parse_checked(&String::from_utf8_lossy(&bytes))?;
    }

    #[test]
    fn yamlish_text_never_panics_and_errors_are_well_formed(text in yamlish()) {
        parse_checked(&text)?;
    }

    #[test]
    fn mutated_configs_never_panic_and_errors_are_well_formed(
        base in prop::sample::select(bases().to_vec()),
        mutations in prop::collection::vec(mutation(), 1..6),
    ) {
        parse_checked(&mutate(base, &mutations))?;
    }

    #[test]
    fn a_truncated_mutation_is_refused_or_has_at_most_its_routes(
        base in prop::sample::select(bases().to_vec()),
        mutations in prop::collection::vec(mutation(), 1..4),
        cut in any::<prop::sample::Index>(),
    ) {
        let text = mutate(base, &mutations);
        if let Some(full) = parse_checked(&text)? {
            let mut end = cut.index(text.len() + 1);
            while !text.is_char_boundary(end) {
                end -= 1;
            }
            if let Some(routes) = parse_checked(&text[..end])? {
                prop_assert!(routes <= full, "{} > {} routes at {}", routes, full, end);
            }
        }
    }
}

/// libyaml reports an error at the end of a file that does not end in a newline one line past
/// the last: `routes:\n  - { name:` (no final newline) is line 3, column 1 to libyaml, in a
/// two-line file, where an editor jumping there finds no such line. sluice reports the end of
/// the last line instead.
#[test]
fn errors_at_the_end_of_a_file_without_a_final_newline_point_inside_it() {
    for text in [
        "routes:\n  - { name:",
        "routes:\n- {",
        "routes:\r- {",
        "routes: [\u{2028}",
    ] {
        if let Err(e) = parse_checked(text) {
            panic!("{e}");
        }
    }
    let e = Config::parse("t.yaml", "routes:\n  - { name:").unwrap_err();
    assert_eq!((e.0[0].line, e.0[0].column), (2, 12), "{e}");
    // With a final newline, the line after it is where the file ends: kept.
    let e = Config::parse("t.yaml", "routes:\n  - { name:\n").unwrap_err();
    assert_eq!((e.0[0].line, e.0[0].column), (3, 1), "{e}");
}
