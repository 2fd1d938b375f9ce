//! `sluice check` on broken configs: each mistake must be reported as
//! `FILE:LINE:COL: PATH: message`, and a good config as `ok`.

mod support;

use std::process::Command;

/// A valid config that the broken cases below start from.
const GOOD: &str = r#"listen: ["127.0.0.1:8080"]
routes:
  - name: api
    match:
      hosts: ["api.test"]
    upstream:
      members:
        - url: "http://127.0.0.1:9001"
"#;

struct Case {
    what: &'static str,
    yaml: &'static str,
    line: usize,
    column: usize,
    path: &'static str,
    message: &'static str,
}

const CASES: &[Case] = &[
    Case {
        what: "YAML syntax: unclosed flow sequence",
        yaml: "listen: [\"127.0.0.1:8080\"\nroutes: []\n",
        line: 1,
        column: 9,
        path: "listen",
        message: "did not find expected ',' or ']'",
    },
    Case {
        what: "YAML syntax: bad indentation",
        yaml: "routes:\n\t- name: a\n",
        line: 2,
        column: 1,
        path: "routes",
        message: "found character that cannot start any token",
    },
    Case {
        what: "wrong type: threads is a word",
        yaml: "threads: many\n",
        line: 1,
        column: 10,
        path: "threads",
        message: "invalid type: string \"many\"",
    },
    Case {
        what: "wrong type: negative retries",
        yaml: "routes:\n  - name: a\n    upstream:\n      retries: -1\n",
        line: 4,
        column: 16,
        path: "routes[0].upstream.retries",
        message: "invalid type: integer `-1`, expected u32",
    },
    Case {
        what: "wrong type: routes is a mapping",
        yaml: "routes:\n  name: a\n",
        line: 2,
        column: 3,
        path: "routes",
        message: "invalid type: map, expected a sequence",
    },
    Case {
        what: "unknown top-level key (typo)",
        yaml: "listn: [\"127.0.0.1:8080\"]\n",
        line: 1,
        column: 1,
        path: "listn",
        message: "unknown field `listn`",
    },
    Case {
        what: "unknown nested key (typo)",
        yaml: "routes:\n  - name: a\n    upstream:\n      member: []\n",
        line: 4,
        column: 7,
        path: "routes[0].upstream.member",
        message: "unknown field `member`",
    },
    Case {
        what: "a cost rule no request could ever pass",
        yaml: "routes:\n  - name: a\n    upstream: {}\n    quota:\n      windows: [{name: s, limit: 10, window: 1s}]\n      cost:\n        rules: [{path_prefix: /x, cost: 11}]\n",
        line: 7,
        column: 41,
        path: "routes[0].quota.cost.rules[0].cost",
        message: "cost 11 exceeds the smallest window limit 10",
    },
    Case {
        what: "a quota keyed by a header with no name",
        yaml: "routes:\n  - name: a\n    upstream: {}\n    quota:\n      key: \"header:\"\n      windows: [{name: s, limit: 10, window: 1s}]\n",
        line: 5,
        column: 12,
        path: "routes[0].quota.key",
        message: "needs a header name",
    },
    Case {
        what: "a zero window",
        yaml: "routes:\n  - name: a\n    upstream: {}\n    quota:\n      windows: [{name: s, limit: 10, window: 0s}]\n",
        line: 5,
        column: 46,
        path: "routes[0].quota.windows[0].window",
        message: "must be greater than zero",
    },
    Case {
        what: "a zero limit",
        yaml: "routes:\n  - name: a\n    upstream: {}\n    quota:\n      windows: [{name: s, limit: 0, window: 1s}]\n",
        line: 5,
        column: 34,
        path: "routes[0].quota.windows[0].limit",
        message: "expected a nonzero u64",
    },
    Case {
        what: "a negative cost",
        yaml: "routes:\n  - name: a\n    upstream: {}\n    quota:\n      windows: [{name: s, limit: 5, window: 1s}]\n      cost: {default: -2}\n",
        line: 6,
        column: 23,
        path: "routes[0].quota.cost.default",
        message: "invalid type: integer `-2`",
    },
    Case {
        what: "two windows with one name",
        yaml: "routes:\n  - name: a\n    upstream: {}\n    quota:\n      windows:\n        - {name: s, limit: 5, window: 1s}\n        - {name: s, limit: 9, window: 1m}\n",
        line: 7,
        column: 18,
        path: "routes[0].quota.windows[1].name",
        message: "duplicate window name",
    },
    Case {
        what: "least_used together with a weight",
        yaml: "routes:\n  - name: a\n    upstream:\n      selection: least_used\n      members:\n        - url: \"http://127.0.0.1:1\"\n          weight: 2\n",
        line: 7,
        column: 19,
        path: "routes[0].upstream.members[0].weight",
        message: "weight applies to round_robin only",
    },
    Case {
        what: "on_restore on a round-robin pool",
        yaml: "routes:\n  - name: a\n    upstream:\n      on_restore: min\n",
        line: 4,
        column: 19,
        path: "routes[0].upstream.on_restore",
        message: "applies to selection: least_used only",
    },
    Case {
        what: "an unknown selection",
        yaml: "routes:\n  - name: a\n    upstream:\n      selection: random\n",
        line: 4,
        column: 18,
        path: "routes[0].upstream.selection",
        message: "unknown variant `random`",
    },
    Case {
        what: "member URL with a non-http scheme",
        yaml: "routes:\n  - name: a\n    upstream:\n      members:\n        - url: \"ftp://x.test\"\n",
        line: 5,
        column: 16,
        path: "routes[0].upstream.members[0].url",
        message: "scheme \"ftp\" is not http or https",
    },
    Case {
        what: "member URL that is not a URL",
        yaml: "routes:\n  - name: a\n    upstream:\n      members:\n        - url: \"not a url\"\n",
        line: 5,
        column: 16,
        path: "routes[0].upstream.members[0].url",
        message: "invalid member url",
    },
    Case {
        what: "member URL with a path",
        yaml: "routes:\n  - name: a\n    upstream:\n      members:\n        - url: \"http://x.test/v1\"\n",
        line: 5,
        column: 16,
        path: "routes[0].upstream.members[0].url",
        message: "without a path",
    },
    Case {
        what: "duplicate route names",
        yaml: "routes:\n  - name: a\n    match: {hosts: [x.test]}\n    upstream: {}\n  - name: a\n    match: {hosts: [y.test]}\n    upstream: {}\n",
        line: 5,
        column: 11,
        path: "routes[1].name",
        message: "duplicate route name \"a\"",
    },
    Case {
        what: "zero duration",
        yaml: "routes:\n  - name: a\n    upstream:\n      connect_timeout: 0s\n",
        line: 4,
        column: 24,
        path: "routes[0].upstream.connect_timeout",
        message: "must be greater than zero",
    },
    Case {
        what: "unparseable duration",
        yaml: "routes:\n  - name: a\n    upstream:\n      read_timeout: 5 parsecs\n",
        line: 4,
        column: 21,
        path: "routes[0].upstream.read_timeout",
        message: "invalid duration \"5 parsecs\"",
    },
    Case {
        what: "zero duration in a health check",
        yaml: "routes:\n  - name: a\n    upstream:\n      health_check: {kind: tcp, interval: 0ms}\n",
        line: 4,
        column: 43,
        path: "routes[0].upstream.health_check.interval",
        message: "must be greater than zero",
    },
    Case {
        what: "zero weight",
        yaml: "routes:\n  - name: a\n    upstream:\n      members:\n        - {url: \"http://127.0.0.1:1\", weight: 0}\n",
        line: 5,
        column: 47,
        path: "routes[0].upstream.members[0].weight",
        message: "expected a nonzero u32",
    },
    Case {
        what: "route name with a space",
        yaml: "routes:\n  - name: my route\n    upstream: {}\n",
        line: 2,
        column: 11,
        path: "routes[0].name",
        message: "invalid route name \"my route\"",
    },
    Case {
        what: "host with a port",
        yaml: "routes:\n  - name: a\n    match:\n      hosts: [\"api.test:443\"]\n    upstream: {}\n",
        line: 4,
        column: 15,
        path: "routes[0].match.hosts[0]",
        message: "give the host without a port",
    },
    Case {
        what: "CONNECT in methods",
        yaml: "routes:\n  - name: a\n    match:\n      methods: [GET, CONNECT]\n    upstream: {}\n",
        line: 4,
        column: 22,
        path: "routes[0].match.methods[1]",
        message: "CONNECT tunnels are not supported",
    },
    Case {
        what: "path_prefix without a leading slash",
        yaml: "routes:\n  - name: a\n    match:\n      path_prefix: v1/\n    upstream: {}\n",
        line: 4,
        column: 20,
        path: "routes[0].match.path_prefix",
        message: "must start with '/'",
    },
    Case {
        what: "the same member twice",
        yaml: "routes:\n  - name: a\n    upstream:\n      members:\n        - url: \"http://127.0.0.1:1\"\n        - url: \"http://127.0.0.1:1\"\n",
        line: 6,
        column: 16,
        path: "routes[0].upstream.members[1].url",
        message: "duplicate member",
    },
    Case {
        what: "two routes that claim the same requests",
        yaml: "routes:\n  - name: a\n    match: {hosts: [x.test]}\n    upstream: {}\n  - name: b\n    match: {hosts: [x.test]}\n    upstream: {}\n",
        line: 6,
        column: 12,
        path: "routes[1].match",
        message: "could never match",
    },
    Case {
        what: "path on a tcp health check",
        yaml: "routes:\n  - name: a\n    upstream:\n      health_check:\n        kind: tcp\n        path: /healthz\n",
        line: 6,
        column: 15,
        path: "routes[0].upstream.health_check.path",
        message: "applies to kind: http only",
    },
    Case {
        what: "listen address without a port",
        yaml: "listen: [\"127.0.0.1\"]\n",
        line: 1,
        column: 10,
        path: "listen[0]",
        message: "expected IP:PORT",
    },
    Case {
        what: "the redis backend without a url",
        yaml: "state:\n  backend: redis\n",
        line: 2,
        column: 12,
        path: "state.backend",
        message: "backend: redis needs state.redis.url or state.redis.cluster",
    },
    Case {
        what: "both a redis url and a cluster",
        yaml: "state:\n  backend: redis\n  redis:\n    url: \"redis://127.0.0.1:6379\"\n    cluster: [\"redis://127.0.0.1:7001\"]\n",
        line: 5,
        column: 14,
        path: "state.redis.cluster",
        message: "not both",
    },
    Case {
        what: "a redis url that is not redis://",
        yaml: "state:\n  backend: redis\n  redis:\n    url: \"http://127.0.0.1:6379\"\n",
        line: 4,
        column: 10,
        path: "state.redis.url",
        message: "invalid redis url",
    },
];

fn check(yaml: &str) -> (i32, String, String, String) {
    let dir = support::TempDir::new("sluice-check");
    let file = dir.path().join("sluice.yaml");
    std::fs::write(&file, yaml).unwrap();
    let out = Command::new(support::sluice_binary())
        .args(["check", "-c"])
        .arg(&file)
        .output()
        .expect("run sluice check");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
        file.display().to_string(),
    )
}

#[test]
fn a_good_config_prints_ok() {
    let (code, stdout, stderr, _) = check(GOOD);
    assert_eq!((code, stdout.as_str(), stderr.as_str()), (0, "ok\n", ""));
}

#[test]
fn the_embedded_default_and_shipped_configs_are_valid() {
    let configs = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../configs");
    for entry in std::fs::read_dir(configs).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "yaml")
            && path.file_name().unwrap() != "prometheus.yaml"
        {
            let (code, stdout, stderr, _) = check(&std::fs::read_to_string(&path).unwrap());
            assert_eq!(code, 0, "{}: {stdout}{stderr}", path.display());
        }
    }
}

#[test]
fn each_broken_config_names_file_line_column_and_path() {
    assert!(CASES.len() >= 15);
    let mut failures = Vec::new();
    for case in CASES {
        let (code, _, stderr, file) = check(case.yaml);
        let prefix = format!("{file}:{}:{}: {}: ", case.line, case.column, case.path);
        let line = stderr.lines().next().unwrap_or("");
        let ok = code == 1 && line.starts_with(&prefix) && line.contains(case.message);
        if !ok {
            failures.push(format!(
                "{}:\n  expected: {prefix}…{}…\n  got (exit {code}): {stderr}",
                case.what, case.message
            ));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn run_with_a_broken_config_exits_1_with_the_same_message() {
    let dir = support::TempDir::new("sluice-run-bad");
    let file = dir.path().join("bad.yaml");
    std::fs::write(&file, "threads: many\n").unwrap();
    let out = Command::new(support::sluice_binary())
        .args(["run", "-c"])
        .arg(&file)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.starts_with(&format!("{}:1:10: threads: ", file.display())),
        "{stderr}"
    );
}

#[test]
fn version_is_printed() {
    let out = Command::new(support::sluice_binary())
        .arg("--version")
        .output()
        .unwrap();
    assert!(out.status.success());
    assert!(String::from_utf8_lossy(&out.stdout).starts_with("sluice "));
}
