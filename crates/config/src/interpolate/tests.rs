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

proptest::proptest! {
    /// Whatever a variable holds, each style reads back exactly that one value, and the
    /// rest of the document (its keys, the line of `next`) does not move.
    #[test]
    fn any_value_reads_back_as_itself(
        chars in proptest::collection::vec(
            proptest::prop_oneof![
                proptest::sample::select(
                    "\"'\\:#-[]{},&*!|>%@`?$ \t\r\n\u{85}\u{2028}\u{2029}\u{feff}\u{0}\u{1b}\u{9f}".chars().collect::<Vec<_>>()
                ),
                proptest::char::any(),
                proptest::char::range('a', 'z'),
            ],
            0..24,
        )
    ) {
        let v: String = chars.into_iter().collect();
        for (text, plain) in [
            ("k: ${V}\nnext: 1\n", true),
            ("k: \"${V}\"\nnext: 1\n", false),
            ("k: '${V}'\nnext: 1\n", false),
            ("k: [${V}, \"${V}\"]\nnext: 1\n", true),
            ("k: {a: ${V}}\nnext: 1\n", true),
            ("k: |\n  ${V}\nnext: 1\n", false),
            ("k:\n  - ${V}\nnext: 1\n", true),
        ] {
            let done = run(text, &[("V", &v)]).unwrap_or_else(|e| panic!("{e:?}"));
            proptest::prop_assert_eq!(done.lines().count(), text.lines().count(), "{:?}", done);
            proptest::prop_assert!(done.ends_with("\nnext: 1\n"), "{:?}", done);
            let got: serde_yaml::Value = serde_yaml::from_str(&done)
                .unwrap_or_else(|e| panic!("{e}: {done:?}"));
            proptest::prop_assert_eq!(got.as_mapping().map(|m| m.len()), Some(2));
            let k = &got["k"];
            let read = if text.contains('|') {
                serde_yaml::Value::String(format!("{v}\n"))
            } else if !plain || !is_plain_word(&v) {
                serde_yaml::Value::String(v.clone())
            } else {
                serde_yaml::from_str(&v).unwrap()
            };
            let first = match k {
                serde_yaml::Value::Sequence(items) => items[0].clone(),
                serde_yaml::Value::Mapping(m) => m["a"].clone(),
                other => other.clone(),
            };
            proptest::prop_assert_eq!(&first, &read, "{:?}", done);
            if text.contains('[') {
                proptest::prop_assert_eq!(&k[1], &serde_yaml::Value::String(v.clone()));
            }
        }
    }
}

proptest::proptest! {
    /// A config whose values are made of `${…}` and YAML's awkward characters either
    /// parses, or fails with errors placed inside the file that never show a value from
    /// the environment, in any case.
    #[test]
    fn variables_anywhere_fail_cleanly_and_never_show_a_secret(
        parts in proptest::collection::vec(
            proptest::collection::vec(
                proptest::sample::select(vec![
                    "${S}", "\"${S}\"", "'${S}'", "\"x${S}y\"", "${S}.test", "\"http://${S}:80\"",
                    "${N}", "${E:-}", "${E:-d}", "${UNSET}", "${UNSET:-1s}", "$${", "${", "}", "${1}",
                    "a", "1s", "/", "\"", "'", ":", ": ", " ", "#", ",", "[", "]", "{", "\r", "\n",
                    "\u{85}", "é", "&a ", "*a", "!!str ", "- ", "|",
                ]),
                0..6,
            ),
            7,
        )
    ) {
        let p: Vec<String> = parts.iter().map(|t| t.concat()).collect();
        let text = format!(
            "threads: {}\nroutes:\n  - name: {}\n    match: {{ hosts: [{}], path_prefix: {} }}\n    upstream:\n      members:\n        - url: {}\n        - url: {}\n    quota:\n      windows: [{{ name: w, limit: {}, window: {} }}]\n",
            p[0], p[1], p[2], p[3], p[4], p[4], p[5], p[6]
        );
        let env = |name: &str| match name {
            "S" => Ok("Sup3r-Secret".to_string()),
            "N" => Ok("7".to_string()),
            "E" => Ok(String::new()),
            _ => Err(VarError::NotPresent),
        };
        if let Err(errors) = super::super::Config::parse_with_env("t.yaml", &text, &env) {
            let printed = errors.to_string().to_lowercase();
            proptest::prop_assert!(!printed.contains("sup3r-secret"), "{}\n{:?}", printed, text);
            // Lines as libyaml counts them.
            let mut lines = vec![String::new()];
            let mut chars = text.chars().peekable();
            while let Some(c) = chars.next() {
                match c {
                    '\r' | '\n' | '\u{85}' | '\u{2028}' | '\u{2029}' => {
                        if c == '\r' && chars.peek() == Some(&'\n') {
                            chars.next();
                        }
                        lines.push(String::new());
                    }
                    c => lines.last_mut().unwrap().push(c),
                }
            }
            for e in &errors.0 {
                if e.line == 0 {
                    continue;
                }
                proptest::prop_assert!(e.line <= lines.len(), "{}\n{:?}", e, text);
                let width = lines[e.line - 1].chars().count();
                proptest::prop_assert!(e.column >= 1 && e.column <= width + 2, "{}\n{:?}", e, text);
            }
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
fn unquoted_in_a_flow_collection() {
    let vars = [("X", "x y"), ("N", "60"), ("K", "key"), ("E", "")];
    assert_eq!(
        value(
            "a: [${X}, pre-${X}-post:8, ${N}, $${N}, ${E:-}]\nb: { limit: ${N}, ${K}: v, s: \"q\" }\nc: [${N} ]  # ${NOT} in a comment\n",
            &vars
        ),
        yaml("a: [x y, 'pre-x y-post:8', 60, '${N}', '']\nb: {limit: 60, key: v, s: q}\nc: [60]\n")
    );
    // Mistakes are shown where the file has them.
    assert_eq!(
        run("a: [${X}, ${X}, ${NOPE}, {k: ${1}}]\n", &vars).unwrap_err(),
        [
            "1:17: a[2]: environment variable NOPE is not set (write `${NOPE:-default}` for a default)",
            "1:30: a[3].k: `${1}` is not `${NAME}` or `${NAME:-default}` with NAME made of letters, digits and '_', not starting with a digit (write `$${` for a literal `${`)",
        ]
    );
}

#[test]
fn anchors_and_tags_are_refused() {
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
fn short_values_are_scrubbed_where_they_stand_alone() {
    let env = |n: &str| match n {
        "ONE" => Ok("1".to_string()),
        "KEY" => Ok("key-1".to_string()),
        _ => Err(VarError::NotPresent),
    };
    let done = interpolate("a: ${ONE}\nb: ${KEY}\n", &env);
    assert_eq!(
        done.scrub("integer `1`, expected u32; 1; 21; key-1 and key-12"),
        "integer `${ONE}`, expected u32; ${ONE}; 21; ${KEY} and ${KEY}2"
    );
    assert_eq!(done.scrub_path("routes[1].key-1[1]"), "routes[1].${KEY}[1]");
}

#[test]
fn scrubbing_is_longest_first_and_one_pass() {
    let env = |n: &str| match n {
        "LONG" => Ok("abcdefgh".to_string()),
        "SHORT" => Ok("abcd".to_string()),
        "N" => Ok("N".to_string()),
        _ => Err(VarError::NotPresent),
    };
    let done = interpolate("a: \"${LONG} ${SHORT} ${N}\"\n", &env);
    assert_eq!(
        done.scrub("abcdefgh abcd abcde N"),
        "${LONG} ${SHORT} ${SHORT}e ${N}"
    );
}
