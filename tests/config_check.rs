//! The command-line contract of `sluice check` and `sluice run` (SPEC §1): exit codes, `ok`,
//! and one `FILE:LINE:COL: PATH: message` line per mistake. The mistakes themselves are tested
//! in the config module's unit tests, without spawning a process per case.

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

fn check(yaml: &str) -> (i32, String, String, String) {
    check_env(yaml, &[])
}

/// `sluice check` on `yaml`, with the variables `vars` set (`None`: removed).
fn check_env(yaml: &str, vars: &[(&str, Option<&str>)]) -> (i32, String, String, String) {
    let dir = support::TempDir::new("sluice-check");
    let file = dir.path().join("sluice.yaml");
    std::fs::write(&file, yaml).unwrap();
    let mut command = Command::new(support::sluice_binary());
    for (name, value) in vars {
        match value {
            Some(value) => command.env(name, value),
            None => command.env_remove(name),
        };
    }
    let out = command
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
fn each_mistake_is_one_line_naming_file_line_column_and_path() {
    // Which mistakes are found, and where, is tested on Config::parse (config/tests.rs); this
    // pins what scripts read: exit 1, nothing on stdout, one line per mistake on stderr.
    let yaml = "routes:\n  - name: a b\n    upstream: {}\n  - name: c\n    upstream:\n      members:\n        - url: \"ftp://x.test\"\n";
    let (code, stdout, stderr, file) = check(yaml);
    assert_eq!((code, stdout.as_str()), (1, ""), "{stderr}");
    let lines: Vec<&str> = stderr.lines().collect();
    assert_eq!(
        lines,
        [
            format!("{file}:2:11: routes[0].name: invalid route name \"a b\": use letters, digits, '_' and '-' only"),
            format!("{file}:7:16: routes[1].upstream.members[0].url: invalid member url \"ftp://x.test\": scheme \"ftp\" is not http or https"),
        ]
    );
}

#[test]
fn variables_come_from_the_environment() {
    let yaml = GOOD.replace(
        "127.0.0.1:9001",
        "${SLUICE_T_CHECK_HOST}:${SLUICE_T_CHECK_PORT:-9001}",
    );
    let host = [("SLUICE_T_CHECK_HOST", Some("127.0.0.1"))];
    let (code, stdout, stderr, _) = check_env(&yaml, &host);
    assert_eq!((code, stdout.as_str(), stderr.as_str()), (0, "ok\n", ""));
    let unset = [("SLUICE_T_CHECK_HOST", None)];
    let (code, stdout, stderr, file) = check_env(&yaml, &unset);
    assert_eq!((code, stdout.as_str()), (1, ""), "{stderr}");
    assert_eq!(
        stderr,
        format!("{file}:8:24: routes[0].upstream.members[0].url: environment variable SLUICE_T_CHECK_HOST is not set (write `${{SLUICE_T_CHECK_HOST:-default}}` for a default)\n")
    );
}

#[test]
fn a_secret_from_the_environment_is_never_printed() {
    // Each value lands in a field that refuses it, and whose error quotes what it refused.
    let secret = "hunter2-Zq9";
    let yaml = "threads: \"${SLUICE_T_CHECK_SECRET}\"
routes:
  - name: \"key ${SLUICE_T_CHECK_SECRET}\"
    upstream: {}
  - name: b
    upstream:
      members:
        - url: \"ftp://${SLUICE_T_CHECK_SECRET}.test\"
  - name: c
    upstream:
      members:
        - proxy: \"http://user:${SLUICE_T_CHECK_SECRET}@proxy.test\"
";
    let (code, stdout, stderr, file) = check_env(yaml, &[("SLUICE_T_CHECK_SECRET", Some(secret))]);
    assert_eq!(code, 1, "{stdout}{stderr}");
    assert!(
        !stdout.contains("hunter2") && !stderr.contains("hunter2"),
        "{stdout}{stderr}"
    );
    let lines: Vec<&str> = stderr.lines().collect();
    assert_eq!(lines.len(), 4, "{stderr}");
    assert!(
        lines[0].starts_with(&format!(
            "{file}:1:10: threads: invalid type: string, expected a nonzero usize"
        )),
        "{stderr}"
    );
    assert!(
        lines[1..3]
            .iter()
            .all(|l| l.contains("${SLUICE_T_CHECK_SECRET}")),
        "{stderr}"
    );
}

#[test]
fn an_empty_file_is_refused() {
    let (code, stdout, stderr, file) = check("");
    assert_eq!((code, stdout.as_str()), (1, ""));
    assert!(
        stderr.starts_with(&format!("{file}:1:1: .: the file is empty")),
        "{stderr}"
    );
}

#[test]
fn run_with_a_broken_config_exits_1_with_the_same_message() {
    let dir = support::TempDir::new("sluice-run-bad");
    let file = dir.path().join("bad.yaml");
    std::fs::write(&file, "threads: many\nroutes: []\n").unwrap();
    let run = |command: &str| {
        Command::new(support::sluice_binary())
            .args([command, "-c"])
            .arg(&file)
            .output()
            .unwrap()
    };
    let (ran, checked) = (run("run"), run("check"));
    assert_eq!(
        (ran.status.code(), checked.status.code()),
        (Some(1), Some(1))
    );
    let stderr = String::from_utf8_lossy(&ran.stderr);
    assert!(
        stderr.starts_with(&format!("{}:1:10: threads: ", file.display())),
        "{stderr}"
    );
    assert_eq!(stderr, String::from_utf8_lossy(&checked.stderr));
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

#[test]
fn usage_metered_windows_are_checked_and_member_calendar_windows_pass() {
    // The contract's example: a route's own windows in units and calendar periods pass, and a
    // member's windows in a unit and in a calendar period.
    let yaml = r#"routes:
  - name: openai
    upstream: { members: [{ url: "http://127.0.0.1:9001" }] }
    quota:
      windows:
        - { name: rpm, limit: 500, window: 1m }
        - { name: tpm, limit: 200000, window: 1m, unit: tokens }
        - { name: month, limit: 400, window: calendar_month, unit: usd, tz: "Europe/Paris" }
      usage:
        tokens:
          reserve: { sum: [ { json: "max_tokens", default: 4096 }, { request_bytes: true, times: 0.25 } ] }
          settle:  { json: "usage.total_tokens" }
        usd:
          reserve: { value: 0.10 }
          settle:
            sum: [ { json: "usage.prompt_tokens", times: 0.0000025 }, { json: "usage.completion_tokens", times: 0.00001 } ]
"#;
    let (code, stdout, stderr, _) = check(yaml);
    assert_eq!(code, 0, "{stdout}{stderr}");
    let member = yaml.replace(
        r#"members: [{ url: "http://127.0.0.1:9001" }]"#,
        r#"members: [{ url: "http://127.0.0.1:9001", quota: { windows: [{ name: k, limit: 9, window: 1m, unit: tokens }, { name: d, limit: 9, window: calendar_day }] } }]"#,
    );
    let (code, stdout, stderr, _) = check(&member);
    assert_eq!(code, 0, "{stdout}{stderr}");
    // Mistakes in the units are placed like any other.
    let (code, _, stderr, file) = check(&yaml.replace("unit: usd,", "unit: eur,"));
    assert_eq!(code, 1, "{stderr}");
    let lines: Vec<&str> = stderr.lines().collect();
    assert_eq!(
        lines,
        [
            format!("{file}:8:68: routes[0].quota.windows[2].unit: unit \"eur\" is not defined: define it under this route's quota.usage, or count requests"),
            format!("{file}:14:11: routes[0].quota.usage.usd: unit \"usd\" is counted by no window: give a window unit: usd, or leave the unit out"),
        ]
    );
    let (code, _, stderr, file) =
        check(&yaml.replace("\"usage.total_tokens\"", "\"choices[0].usage\""));
    assert_eq!(code, 1, "{stderr}");
    assert_eq!(
        stderr,
        format!("{file}:12:28: routes[0].quota.usage.tokens.settle.json: invalid json path \"choices[0].usage\": write object keys joined by dots, such as usage.total_tokens (no brackets, wildcards, spaces or empty keys)\n"),
    );
}

/// A secret written in the file itself, in the wrong place or in a URL that does not parse, is
/// not printed either: a token where a list of them belongs, a key where a map of headers does,
/// and a proxy's password with a `/` in it.
#[test]
fn a_secret_written_in_the_file_is_never_printed() {
    let yaml = r#"routes:
  - name: api
    match: {hosts: ["api.test"]}
    upstream:
      members:
        - url: "http://127.0.0.1:9001"
          headers: "Bearer sk-live-hunter2"
  - name: out
    match: {hosts: ["*"]}
    upstream:
      members:
        - proxy: "http://user:hunter2/x@proxy.test"
clients:
  list:
    - { name: billing, tokens: "hunter2-billing-token", routes: [api] }
"#;
    let (code, stdout, stderr, file) = check(yaml);
    assert_eq!((code, stdout.as_str()), (1, ""), "{stderr}");
    assert!(!stderr.contains("hunter2"), "{stderr}");
    let lines: Vec<&str> = stderr.lines().collect();
    assert_eq!(lines.len(), 3, "{stderr}");
    assert!(
        lines.iter().all(|l| l.starts_with(&file)),
        "each names the file: {stderr}"
    );
}
