//! `Config::parse` on broken configs: each mistake must come out as
//! `FILE:LINE:COL: PATH: message`, at the node to blame.

use super::*;

/// The errors for `yaml`, as `LINE:COL: PATH: message` (the file name is always `t.yaml`).
pub(super) fn errors(yaml: &str) -> Vec<String> {
    match Config::parse("t.yaml", yaml) {
        Ok(_) => Vec::new(),
        Err(ConfigErrors(all)) => all
            .iter()
            .map(|e| {
                assert_eq!(e.file, "t.yaml");
                format!("{}:{}: {}: {}", e.line, e.column, e.path, e.message)
            })
            .collect(),
    }
}

/// Asserts that `yaml` has exactly one mistake, placed at `at` (`LINE:COL: PATH`), whose
/// message contains `message`.
#[track_caller]
pub(super) fn one_error(yaml: &str, at: &str, message: &str) {
    let all = errors(yaml);
    let prefix = format!("{at}: ");
    assert!(
        all.len() == 1 && all[0].starts_with(&prefix) && all[0].contains(message),
        "expected one error `{prefix}…{message}…`, got {all:#?}"
    );
}

fn parse(yaml: &str) -> Config {
    Config::parse("t.yaml", yaml).unwrap_or_else(|e| panic!("{e}"))
}

#[test]
fn the_embedded_default_is_valid() {
    let config = parse(EMBEDDED_DEFAULT);
    assert!(!config.routes.is_empty());
}

// What `sluice check` has always reported, one mistake at a time.

#[test]
fn yaml_syntax_errors() {
    one_error(
        "listen: [\"127.0.0.1:8080\"\nroutes: []\n",
        "1:9: listen",
        "did not find expected ',' or ']'",
    );
    one_error(
        "routes:\n\t- name: a\n",
        "2:1: routes",
        "found character that cannot start any token",
    );
}

#[test]
fn wrong_types() {
    one_error(
        "threads: many\nroutes: []\n",
        "1:10: threads",
        "invalid type: string, expected a nonzero usize",
    );
    one_error(
        "routes:\n  - name: a\n    upstream:\n      retries: -1\n",
        "4:16: routes[0].upstream.retries",
        "integer `-1`, expected u32",
    );
    one_error(
        "routes:\n  name: a\n",
        "2:3: routes",
        "invalid type: map, expected a sequence",
    );
}

#[test]
fn unknown_keys_are_shown_at_the_key() {
    one_error(
        "listn: [\"127.0.0.1:8080\"]\nroutes: []\n",
        "1:1: listn",
        "unknown field `listn`",
    );
    one_error(
        "routes:\n  - name: a\n    upstream:\n      member: []\n",
        "4:7: routes[0].upstream.member",
        "unknown field `member`",
    );
}

#[test]
fn quota_mistakes() {
    one_error(
        "routes:\n  - name: a\n    upstream: {}\n    quota:\n      windows: [{name: s, limit: 10, window: 1s}]\n      cost:\n        rules: [{path_prefix: /x, cost: 11}]\n",
        "7:41: routes[0].quota.cost.rules[0].cost",
        "cost 11 exceeds the smallest window limit 10",
    );
    one_error(
        "routes:\n  - name: a\n    upstream: {}\n    quota:\n      key: \"header:\"\n      windows: [{name: s, limit: 10, window: 1s}]\n",
        "5:12: routes[0].quota.key",
        "needs a header name",
    );
    one_error(
        "routes:\n  - name: a\n    upstream: {}\n    quota:\n      windows: [{name: s, limit: 10, window: 0s}]\n",
        "5:46: routes[0].quota.windows[0].window",
        "must be greater than zero",
    );
    one_error(
        "routes:\n  - name: a\n    upstream: {}\n    quota:\n      windows: [{name: s, limit: 0, window: 1s}]\n",
        "5:34: routes[0].quota.windows[0].limit",
        "expected a nonzero u64",
    );
    one_error(
        "routes:\n  - name: a\n    upstream: {}\n    quota:\n      windows: [{name: s, limit: 5, window: 1s}]\n      cost: {default: -2}\n",
        "6:23: routes[0].quota.cost.default",
        "integer `-2`",
    );
    one_error(
        "routes:\n  - name: a\n    upstream: {}\n    quota:\n      windows:\n        - {name: s, limit: 5, window: 1s}\n        - {name: s, limit: 9, window: 1m}\n",
        "7:18: routes[0].quota.windows[1].name",
        "duplicate window name",
    );
}

#[test]
fn selection_names_a_policy() {
    // Which policies exist is the policies' own rule (the gateway's `select::RULES`); the config
    // reads a name.
    one_error(
        "routes:\n  - name: a\n    upstream:\n      selection: Least-Used\n",
        "4:18: routes[0].upstream.selection",
        "is not a policy name",
    );
}

#[test]
fn member_url_mistakes() {
    let member = |url: &str| {
        format!("routes:\n  - name: a\n    upstream:\n      members:\n        - url: \"{url}\"\n")
    };
    let at = "5:16: routes[0].upstream.members[0].url";
    one_error(
        &member("ftp://x.test"),
        at,
        "scheme \"ftp\" is not http or https",
    );
    one_error(&member("not a url"), at, "invalid member url");
    one_error(&member("http://x.test/v1"), at, "without a path");
    one_error(
        "routes:\n  - name: a\n    upstream:\n      members:\n        - url: \"http://127.0.0.1:1\"\n        - url: \"http://127.0.0.1:1\"\n",
        "6:16: routes[0].upstream.members[1].url",
        "duplicate member",
    );
    one_error(
        "routes:\n  - name: a\n    upstream:\n      members:\n        - {url: \"http://127.0.0.1:1\", weight: 0}\n",
        "5:47: routes[0].upstream.members[0].weight",
        "expected a nonzero u32",
    );
}

#[test]
fn duration_mistakes() {
    one_error(
        "routes:\n  - name: a\n    upstream:\n      connect_timeout: 0s\n",
        "4:24: routes[0].upstream.connect_timeout",
        "must be greater than zero",
    );
    one_error(
        "routes:\n  - name: a\n    upstream:\n      read_timeout: 5 parsecs\n",
        "4:21: routes[0].upstream.read_timeout",
        "invalid duration \"5 parsecs\"",
    );
    one_error(
        "routes:\n  - name: a\n    upstream:\n      health_check: {kind: tcp, interval: 0ms}\n",
        "4:43: routes[0].upstream.health_check.interval",
        "must be greater than zero",
    );
}

#[test]
fn route_and_match_mistakes() {
    one_error(
        "routes:\n  - name: a\n    match: {hosts: [x.test]}\n    upstream: {}\n  - name: a\n    match: {hosts: [y.test]}\n    upstream: {}\n",
        "5:11: routes[1].name",
        "duplicate route name \"a\"",
    );
    one_error(
        "routes:\n  - name: my route\n    upstream: {}\n",
        "2:11: routes[0].name",
        "invalid route name \"my route\"",
    );
    one_error(
        "routes:\n  - name: a\n    match:\n      hosts: [\"api.test:443\"]\n    upstream: {}\n",
        "4:15: routes[0].match.hosts[0]",
        "give the host without a port",
    );
    one_error(
        "routes:\n  - name: a\n    match:\n      path_prefix: v1/\n    upstream: {}\n",
        "4:20: routes[0].match.path_prefix",
        "must start with '/'",
    );
    one_error(
        "routes:\n  - name: a\n    match: {hosts: [x.test]}\n    upstream: {}\n  - name: b\n    match: {hosts: [x.test]}\n    upstream: {}\n",
        "6:12: routes[1].match",
        "could never match",
    );
    one_error(
        "routes:\n  - name: a\n    upstream:\n      health_check:\n        kind: tcp\n        path: /healthz\n",
        "6:15: routes[0].upstream.health_check.path",
        "applies to kind: http only",
    );
}

#[test]
fn listen_and_state_mistakes() {
    one_error(
        "listen: [\"127.0.0.1\"]\nroutes: []\n",
        "1:10: listen[0]",
        "expected IP:PORT",
    );
    one_error(
        "state:\n  backend: redis\nroutes: []\n",
        "2:12: state.backend",
        "backend: redis needs state.redis.url or state.redis.cluster",
    );
    one_error(
        "state:\n  backend: redis\n  redis:\n    url: \"redis://127.0.0.1:6379\"\n    cluster: [\"redis://127.0.0.1:7001\"]\nroutes: []\n",
        "5:14: state.redis.cluster",
        "not both",
    );
    one_error(
        "state:\n  backend: redis\n  redis:\n    url: \"http://127.0.0.1:6379\"\nroutes: []\n",
        "4:10: state.redis.url",
        "invalid redis url",
    );
}

#[test]
fn priority_selection() {
    let config = parse(
        "routes:\n  - name: a\n    upstream:\n      selection: priority\n      members:\n        - url: \"http://primary.test\"\n        - url: \"http://backup.test\"\n",
    );
    let up = &config.routes[0].upstream;
    assert_eq!(up.selection, Selection::named("priority"));
    assert_eq!(up.members[1].url.host, "backup.test");
}

#[test]
fn scalars_are_read_as_written_where_text_is_expected() {
    // A mistake sends the file through a second, value-by-value reading, where a plain 007 is
    // the number 7. Both readings must agree: the route is "007", and only the real mistake
    // (the second route's retries) is reported, not the names.
    let routes = "routes:\n  - name: 007\n    upstream: {}\n  - name: 1e3\n    match: {hosts: [b]}\n    upstream: {}\n  - name: \"true\"\n    match: {hosts: [c]}\n    upstream: {}\n";
    let config = parse(routes);
    let names: Vec<&str> = config.routes.iter().map(|r| r.name.0.as_str()).collect();
    assert_eq!(names, ["007", "1e3", "true"]);
    let broken =
        format!("admin: {{token_env: 1}}\n{routes}  - name: 0x1F\n    upstream: {{retries: x}}\n");
    assert_eq!(
        errors(&broken),
        ["12:25: routes[3].upstream.retries: invalid type: string, expected u32"]
    );
    // A number where a string is wanted, in a field that takes no number, is still refused.
    one_error(
        "routes:\n  - name: a\n    upstream: {members: [{url: 80}]}\n",
        "3:32: routes[0].upstream.members[0].url",
        "invalid member url \"80\"",
    );
}

// Every mistake at once, and in linear time.

#[test]
fn every_broken_route_is_reported_not_just_the_first() {
    let yaml = "threads: many\nroutes:\n  - name: a\n    upstream: {retries: x}\n  - name: ok\n    upstream: {}\n  - name: c d\n    upstream: {}\n  - name: e\n    upstream: {members: [{url: \"ftp://x\"}]}\n";
    assert_eq!(
        errors(yaml),
        [
            "1:10: threads: invalid type: string, expected a nonzero usize",
            "4:25: routes[0].upstream.retries: invalid type: string, expected u32",
            "7:11: routes[2].name: invalid route name \"c d\": use letters, digits, '_' and '-' only",
            "10:32: routes[3].upstream.members[0].url: invalid member url \"ftp://x\": scheme \"ftp\" is not http or https",
        ]
    );
}

#[test]
fn a_thousand_duplicate_route_names_give_999_errors() {
    // Placing each error used to re-parse the whole file: 19.5 s for this config. The
    // positions are now indexed once (see position.rs); the time is not asserted here.
    let mut yaml = String::from("routes:\n");
    for i in 0..1000 {
        yaml.push_str(&format!(
            "  - name: same\n    match: {{hosts: [h{i}.test]}}\n    upstream: {{}}\n"
        ));
    }
    let all = errors(&yaml);
    assert_eq!(all.len(), 999);
    assert_eq!(
        all[0],
        "5:11: routes[1].name: duplicate route name \"same\": routes[0] already has it"
    );
    assert_eq!(
        all[998],
        "2999:11: routes[999].name: duplicate route name \"same\": routes[0] already has it"
    );
}

// An empty or truncated file is never taken for a config with no routes.

#[test]
fn an_empty_document_is_an_error() {
    for yaml in ["", "\n\n", "# only a comment\n   \n", "---\n"] {
        let all = errors(yaml);
        assert_eq!(all.len(), 1, "{yaml:?}: {all:?}");
        assert!(
            all[0].starts_with("1:1: .: the file is empty; write `routes: []`"),
            "{yaml:?}: {all:?}"
        );
    }
}

#[test]
fn routes_must_be_written_even_when_there_are_none() {
    one_error(
        "listen: [\"127.0.0.1:8080\"]\n",
        "1:1: .",
        "no routes key; write `routes: []` to run with no routes",
    );
    one_error(
        "listen: [\"127.0.0.1:8080\"]\nroutes:\n",
        "2:8: routes",
        "routes is empty; write `routes: []`",
    );
    assert!(parse("routes: []\n").routes.is_empty());
    // A top-level mistake and the missing key are both reported.
    assert_eq!(errors("threads: 0\n").len(), 2);
}

#[test]
fn a_document_that_is_not_a_mapping_is_an_error() {
    one_error(
        "just words\n",
        "1:1: .",
        "expected a mapping of settings such as `routes:`, found a string",
    );
    one_error("[1, 2]\n", "1:1: .", "found a sequence");
}

/// A complex key (`? …`) may span lines; its error is still one line, the key's line breaks
/// written escaped (found by the proptest of YAML-ish text).
#[test]
fn a_key_that_spans_lines_keeps_its_error_on_one_line() {
    let errors = Config::parse("t.yaml", "?     match:~\n\n  - name: a").unwrap_err();
    let printed = errors.to_string();
    assert_eq!(printed.lines().count(), errors.0.len(), "{printed}");
    assert!(printed.contains("\\n"), "{printed}");
}

// What once passed `check` and then failed, panicked or misbehaved at `run`.

fn with_redis(redis: &str) -> String {
    format!("state:\n  backend: redis\n  redis:\n{redis}routes: []\n")
}

#[test]
fn redis_urls_are_checked_by_the_client_itself() {
    // This used to pass `check` and panic at `run`.
    one_error(
        &with_redis("    url: \"redis://127.0.0.1/x\"\n"),
        "4:10: state.redis.url",
        "invalid redis url \"redis://127.0.0.1/x\": Invalid database number",
    );
    one_error(
        &with_redis("    url: \"rediss://127.0.0.1:6380/x\"\n"),
        "4:10: state.redis.url",
        "invalid redis url \"rediss://127.0.0.1:6380/x\": Invalid database number",
    );
    one_error(
        &with_redis("    url: \"redis://\"\n"),
        "4:10: state.redis.url",
        "invalid redis url",
    );
    let config = parse(&with_redis(
        "    url: \"redis://user:pw@127.0.0.1:6379/2\"\n",
    ));
    let url = config.state.redis.unwrap().url.unwrap();
    assert_eq!(url.0, "redis://user:pw@127.0.0.1:6379/2");
}

/// Requests that wait together share a Redis call unless `state.redis.batch: false`.
#[test]
fn redis_batching_is_on_unless_turned_off() {
    let url = "    url: \"redis://127.0.0.1:6379\"\n";
    let on = parse(&with_redis(url));
    assert!(on.state.redis.unwrap().batch);
    let off = parse(&with_redis(&format!("{url}    batch: false\n")));
    assert!(!off.state.redis.unwrap().batch);
}

#[test]
fn rediss_urls_and_their_ca_file() {
    // TLS with the system's roots.
    let config = parse(&with_redis("    url: \"rediss://:pw@127.0.0.1:6380/0\"\n"));
    let redis = config.state.redis.unwrap();
    assert!(redis.url.unwrap().is_tls());
    assert_eq!(redis.tls, None);
    parse(&with_redis(
        "    cluster: [\"rediss://127.0.0.1:7001\", \"rediss://127.0.0.1:7002\"]\n",
    ));

    // With a private CA.
    let dir = std::env::temp_dir().join(format!("sluice-config-ca-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    sluice_testkit::make_certificates(&dir, "IP:127.0.0.1");
    let ca = dir.join("ca.pem");
    let with_ca = |url: &str, ca: &std::path::Path| {
        with_redis(&format!(
            "    url: \"{url}\"\n    tls:\n      ca: {}\n",
            ca.display()
        ))
    };
    let config = parse(&with_ca("rediss://127.0.0.1:6380/0", &ca));
    let tls = config.state.redis.unwrap().tls.unwrap();
    assert_eq!(tls.ca.as_deref(), Some(ca.as_path()));

    // A missing file is named, at the key.
    let missing = dir.join("missing.pem");
    one_error(
        &with_ca("rediss://127.0.0.1:6380/0", &missing),
        "6:11: state.redis.tls.ca",
        &format!("CA file {}: cannot be read", missing.display()),
    );
    // So is a file with no certificate in it (a key is not a CA), or one that is not PEM.
    one_error(
        &with_ca("rediss://127.0.0.1:6380/0", &dir.join("ca.key")),
        "6:11: state.redis.tls.ca",
        "holds no PEM certificate",
    );
    let garbled = dir.join("garbled.pem");
    std::fs::write(
        &garbled,
        "-----BEGIN CERTIFICATE-----\nnot base64!\n-----END CERTIFICATE-----\n",
    )
    .unwrap();
    one_error(
        &with_ca("rediss://127.0.0.1:6380/0", &garbled),
        "6:11: state.redis.tls.ca",
        "is not valid PEM",
    );
    // TLS settings with a plain URL would do nothing; say so, without quoting the URL.
    let all = errors(&with_ca("redis://:s3cret@127.0.0.1:6379/0", &ca));
    assert_eq!(all.len(), 1, "{all:?}");
    assert!(
        all[0].starts_with("6:7: state.redis.tls: ") && all[0].contains("use rediss://"),
        "{all:?}"
    );
    assert!(!all[0].contains("s3cret"), "{all:?}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn cluster_nodes_must_agree() {
    one_error(
        &with_redis(
            "    cluster: [\"redis://:one@127.0.0.1:7001\", \"redis://:two@127.0.0.1:7002\"]\n",
        ),
        "4:14: state.redis.cluster",
        "Cannot use different password among initial nodes",
    );
}

#[test]
fn passwords_never_appear_in_error_messages() {
    let cases = [
        with_redis("    url: \"redis://admin:s3cret@127.0.0.1/x\"\n"),
        with_redis("    url: \"rediss://:s3cret@127.0.0.1/x\"\n"),
        with_redis("    cluster: [\"redis://:s3cret@h:1\", \"redis://:other@h:2\"]\n"),
        "routes:\n  - name: a\n    upstream:\n      members: [{url: \"http://u:s3cret@a.test\"}]\n"
            .to_string(),
        "routes:\n  - name: a\n    upstream:\n      members: [{url: \"ftp://u:s3cret@a.test/x\"}]\n"
            .to_string(),
    ];
    for yaml in &cases {
        let all = errors(yaml);
        assert_eq!(all.len(), 1, "{all:?}");
        assert!(!all[0].contains("s3cret"), "{}", all[0]);
    }
    assert!(errors(&cases[0])[0].contains("\"redis://***@127.0.0.1/x\""));
    assert!(errors(&cases[3])[0].contains("credentials in a member url are never sent"));
    assert_eq!(super::urls::redact("http://a@b@c/x@y"), "http://***@c/x@y");
    assert_eq!(super::urls::redact("redis://h:1/0"), "redis://h:1/0");
    // A password with a `/`, `?` or `#` in it: the authority cannot be told from a path.
    assert_eq!(
        super::urls::redact("http://u:pa/ss@10.0.0.5"),
        "http://***@10.0.0.5"
    );
    assert_eq!(
        super::urls::redact("redis://:s3cr/t?x#y@127.0.0.1:6379/0"),
        "redis://***@127.0.0.1:6379/0"
    );
}

/// A password with a `/` is refused (the URL does not parse as the author meant), and the
/// error does not quote it: neither a Redis URL nor a proxy member's.
#[test]
fn a_password_with_a_slash_is_not_quoted_either() {
    let cases = [
        "state:\n  backend: redis\n  redis:\n    url: \"redis://:s3cr/et@127.0.0.1:6379/0\"\nroutes: []\n",
        "routes:\n  - name: a\n    match: {hosts: [\"*\"]}\n    upstream:\n      members: [{proxy: \"http://u:s3cr/et@proxy.test\"}]\n",
    ];
    for yaml in cases {
        let all = errors(yaml);
        assert!(!all.is_empty(), "{yaml}");
        for e in &all {
            assert!(!e.contains("s3cr"), "{e}");
        }
    }
}

/// A value written where another type belongs is not quoted in the error: it may be a secret
/// (a token where a list of them belongs, a key where a map of headers does). The error still
/// names its place and what was expected.
#[test]
fn a_string_of_the_wrong_type_is_not_quoted() {
    let yaml = "routes:\n  - name: a\n    upstream:\n      members:\n        - url: \"http://127.0.0.1:9\"\n          headers: \"Bearer sk-live-0123456789\"\n";
    let all = errors(yaml);
    assert_eq!(all.len(), 1, "{all:?}");
    assert!(!all[0].contains("sk-live"), "{}", all[0]);
    assert!(
        all[0].contains("routes[0].upstream.members[0].headers"),
        "{}",
        all[0]
    );
    assert!(
        all[0].contains("invalid type: string, expected a YAML mapping"),
        "{}",
        all[0]
    );
    assert_eq!(
        super::hide_strings(r#"invalid value: string "a\"b\\", expected x; string "c" d"#),
        "invalid value: string, expected x; string d"
    );
    assert_eq!(super::hide_strings("string \"unclosed"), "string");
}

#[test]
fn an_empty_host_list_is_refused() {
    one_error(
        "routes:\n  - name: a\n    match: {hosts: []}\n    upstream: {}\n",
        "3:20: routes[0].match.hosts",
        "hosts is empty, so the route could never match",
    );
}

fn with_window(window: &str, limit: &str) -> String {
    format!("routes:\n  - name: a\n    upstream: {{}}\n    quota:\n      windows: [{{name: w, limit: {limit}, window: {window}}}]\n")
}

#[test]
fn windows_are_between_1ms_and_366d() {
    one_error(
        &with_window("500us", "1"),
        "5:45: routes[0].quota.windows[0].window",
        "window 500us is shorter than 1ms",
    );
    one_error(
        &with_window("367d", "1"),
        "5:45: routes[0].quota.windows[0].window",
        "367d is too long: a window can be at most 366d",
    );
    parse(&with_window("1ms", "1"));
    parse(&with_window("366d", "1"));
}

#[test]
fn limits_stay_exact_in_redis_doubles() {
    one_error(
        &with_window("1s", "9007199254740993"),
        "5:34: routes[0].quota.windows[0].limit",
        "limit 9007199254740993 is too large: at most 2^53",
    );
    parse(&with_window("1s", "9007199254740992"));
}

#[test]
fn timeouts_intervals_and_cooldowns_are_at_most_a_day() {
    let yaml = "state:\n  redis: {url: \"redis://h\", timeout: 2d}\nroutes:\n  - name: a\n    upstream:\n      connect_timeout: 25h\n      read_timeout: 1d\n      passive: {cooldown: 30d}\n      health_check: {kind: tcp, interval: 1000d, timeout: 2d}\n";
    assert_eq!(
        errors(yaml),
        [
            "2:38: state.redis.timeout: 2d is too long: a Redis timeout can be at most 1d",
            "6:24: routes[0].upstream.connect_timeout: 25h is too long: a timeout can be at most 1d",
            "8:27: routes[0].upstream.passive.cooldown: 30d is too long: a cooldown can be at most 1d",
            "9:43: routes[0].upstream.health_check.interval: 1000d is too long: an interval can be at most 1d",
            "9:59: routes[0].upstream.health_check.timeout: 2d is too long: a timeout can be at most 1d",
        ]
    );
}

#[test]
fn ipv6_hosts_are_accepted_bare_or_in_brackets() {
    let config = parse(
        "routes:\n  - name: a\n    match: {hosts: [\"::1\", \"[2001:DB8:0::A]\"]}\n    upstream: {}\n",
    );
    assert_eq!(
        config.routes[0].matcher.hosts,
        [
            HostPattern::Exact("::1".into()),
            HostPattern::Exact("2001:db8::a".into())
        ]
    );
    // One address, two spellings: the second route could never match.
    one_error(
        "routes:\n  - name: a\n    match: {hosts: [\"::1\"]}\n    upstream: {}\n  - name: b\n    match: {hosts: [\"[::1]\"]}\n    upstream: {}\n",
        "6:12: routes[1].match",
        "could never match",
    );
    one_error(
        "routes:\n  - name: a\n    match: {hosts: [\"[::1]:8080\"]}\n    upstream: {}\n",
        "3:21: routes[0].match.hosts[0]",
        "give the host without a port",
    );
}

#[test]
fn listen_addresses_must_be_real_and_distinct() {
    // admin.listen not written: its default is blamed at the top of the file.
    one_error(
        "listen: [\"127.0.0.1:9901\"]\nroutes: []\n",
        "1:1: admin.listen",
        "127.0.0.1:9901 is also listen[0]: the admin API needs an address of its own",
    );
    one_error(
        "listen: [\"127.0.0.1:8080\"]\nadmin: {listen: \"127.0.0.1:8080\"}\nroutes: []\n",
        "2:17: admin.listen",
        "is also listen[0]",
    );
    one_error(
        "listen: [\"127.0.0.1:0\"]\nroutes: []\n",
        "1:10: listen[0]",
        "port 0 would listen on a random port",
    );
    one_error(
        "admin: {listen: \"[::1]:0\"}\nroutes: []\n",
        "1:17: admin.listen",
        "port 0 would listen on a random port",
    );
    one_error(
        "listen: [\"127.0.0.1:8080\", \"127.0.0.1:8080\"]\nroutes: []\n",
        "1:28: listen[1]",
        "127.0.0.1:8080 is already listen[0]",
    );
}

#[test]
fn member_urls_are_one_member_however_spelled() {
    let config = parse(
        "routes:\n  - name: a\n    upstream:\n      members: [{url: \"HTTP://API.Example.COM:8080/\"}, {url: \"https://[::1]\"}]\n",
    );
    let members = &config.routes[0].upstream.members;
    assert_eq!(members[0].url.url, "http://api.example.com:8080");
    assert_eq!(members[0].url.host, "api.example.com");
    assert_eq!(
        (members[1].url.url.as_str(), members[1].url.host.as_str()),
        ("https://[::1]", "::1")
    );
    for twin in ["http://a.test", "http://a.test:80", "HTTP://A.TEST/"] {
        let yaml = format!(
            "routes:\n  - name: a\n    upstream:\n      members:\n        - url: \"http://a.test\"\n        - url: \"{twin}\"\n"
        );
        one_error(
            &yaml,
            "6:16: routes[0].upstream.members[1].url",
            "in this pool: members[0] is the same",
        );
    }
}

#[test]
fn egress_defaults_and_a_full_section() {
    let config = parse("routes: []\n");
    assert_eq!(config.egress, EgressConfig::default());
    assert_eq!(config.egress.deny, vec![DenyEntry::Private]);
    assert_eq!(
        config.egress.connect_ports,
        vec![
            std::num::NonZeroU16::new(443).unwrap(),
            std::num::NonZeroU16::new(80).unwrap()
        ]
    );
    let config = parse(
        "egress:\n  deny: [private, 198.51.100.0/24, \"2001:db8::/32\", 192.0.2.7]\n  allow_cidrs: [10.20.0.0/16, \"fd00::/8\"]\n  connect_ports: [443, 8443]\nroutes: []\n",
    );
    let cidr = |s: &str| Cidr(s.parse().unwrap());
    assert_eq!(
        config.egress.deny,
        vec![
            DenyEntry::Private,
            DenyEntry::Cidr(cidr("198.51.100.0/24")),
            DenyEntry::Cidr(cidr("2001:db8::/32")),
            DenyEntry::Cidr(cidr("192.0.2.7/32")),
        ]
    );
    assert_eq!(
        config.egress.allow_cidrs,
        vec![cidr("10.20.0.0/16"), cidr("fd00::/8")]
    );
    assert_eq!(config.egress.connect_ports.len(), 2);
    assert!(parse("egress: {deny: []}\nroutes: []\n")
        .egress
        .deny
        .is_empty());
}

#[test]
fn egress_mistakes() {
    one_error(
        "egress:\n  allow_cidrs: [10.20.0.0/33]\nroutes: []\n",
        "2:17: egress.allow_cidrs[0]",
        "invalid CIDR \"10.20.0.0/33\"",
    );
    one_error(
        "egress:\n  allow_cidrs: [\"10.0.0.1/8\"]\nroutes: []\n",
        "2:17: egress.allow_cidrs[0]",
        "bits are set after the /8 prefix; did you mean 10.0.0.0/8?",
    );
    one_error(
        "egress:\n  deny: [privat]\nroutes: []\n",
        "2:10: egress.deny[0]",
        "invalid deny entry \"privat\": expected private, a CIDR",
    );
    one_error(
        "egress:\n  deny: [private, \"fd00::1/8\"]\nroutes: []\n",
        "2:19: egress.deny[1]",
        "did you mean fd00::/8?",
    );
    one_error(
        "egress:\n  connect_ports: [443, 0]\nroutes: []\n",
        "2:24: egress.connect_ports[1]",
        "expected a nonzero u16",
    );
    one_error(
        "egress:\n  connect_ports: [70000]\nroutes: []\n",
        "2:19: egress.connect_ports[0]",
        "expected a nonzero u16",
    );
    one_error(
        "egress:\n  allow: [10.0.0.0/8]\nroutes: []\n",
        "2:3: egress.allow",
        "unknown field `allow`",
    );
    one_error(
        "egress:\n  deny: [private, 10.1.0.0/16]\n  allow_cidrs: [10.0.0.0/8]\nroutes: []\n",
        "2:19: egress.deny[1]",
        "10.1.0.0/16 is inside allow_cidrs[0] (10.0.0.0/8), and allow_cidrs win over deny",
    );
}

#[test]
fn dns_servers_default_to_the_system_and_are_checked() {
    assert_eq!(parse("routes: []\n").dns, DnsConfig::default());
    let config =
        parse("dns:\n  servers: [\"127.0.0.1:5353\", \"[::1]:53\", 192.0.2.53]\nroutes: []\n");
    let servers: Vec<std::net::SocketAddr> = config.dns.servers.iter().map(|s| s.0).collect();
    assert_eq!(
        servers,
        [
            "127.0.0.1:5353".parse().unwrap(),
            "[::1]:53".parse().unwrap(),
            "192.0.2.53:53".parse().unwrap(),
        ]
    );
    one_error(
        "dns:\n  servers: [\"127.0.0.1:5353\", dns.example:53]\nroutes: []\n",
        "2:31: dns.servers[1]",
        "expected IP:PORT such as 127.0.0.1:5353",
    );
    one_error(
        "dns:\n  servers: [\"127.0.0.1:0\"]\nroutes: []\n",
        "2:13: dns.servers[0]",
        "port 0",
    );
    one_error(
        "dns:\n  servers: [\"0.0.0.0:53\"]\nroutes: []\n",
        "2:13: dns.servers[0]",
        "not an address a query can be sent to",
    );
    one_error(
        "dns:\n  server: [\"127.0.0.1:53\"]\nroutes: []\n",
        "2:3: dns.server",
        "unknown field",
    );
}

#[test]
fn limits_have_defaults_and_are_checked() {
    let config = parse("routes: []\n");
    assert_eq!(config.limits, LimitsConfig::default());
    assert_eq!(
        config.limits.idle_timeout.0,
        std::time::Duration::from_secs(60)
    );
    assert_eq!(
        config.limits.header_timeout.0,
        std::time::Duration::from_secs(30)
    );
    assert_eq!(config.limits.max_header_bytes.get(), 65536);
    assert_eq!(config.limits.max_connections, None);

    let config = parse(
        "limits:\n  max_connections: 100\n  idle_timeout: 5s\n  header_timeout: 2s\n  max_header_bytes: 8192\nroutes: []\n",
    );
    assert_eq!(config.limits.max_connections.map(|n| n.get()), Some(100));
    assert_eq!(
        config.limits.idle_timeout.0,
        std::time::Duration::from_secs(5)
    );
    assert_eq!(
        config.limits.header_timeout.0,
        std::time::Duration::from_secs(2)
    );
    assert_eq!(config.limits.max_header_bytes.get(), 8192);

    one_error(
        "limits:\n  max_header_bytes: 2000000\nroutes: []\n",
        "2:21: limits.max_header_bytes",
        "Pingora reads at most 1048575 bytes",
    );
    one_error(
        "limits:\n  idle_timeout: 2d\nroutes: []\n",
        "2:17: limits.idle_timeout",
        "at most 1d",
    );
    one_error(
        "limits:\n  max_connections: 0\nroutes: []\n",
        "2:20: limits.max_connections",
        "",
    );
    one_error(
        "limits:\n  idle: 1s\nroutes: []\n",
        "2:3: limits.idle",
        "unknown field",
    );
}

#[test]
fn write_timeout_defaults_to_the_read_timeout_default() {
    let config = parse("routes:\n  - name: a\n    upstream:\n      members: []\n");
    let up = &config.routes[0].upstream;
    assert_eq!(up.write_timeout, up.read_timeout);
    one_error(
        "routes:\n  - name: a\n    upstream:\n      write_timeout: 2d\n      members: []\n",
        "4:22: routes[0].upstream.write_timeout",
        "at most 1d",
    );
}

// SPEC §7: member kinds.

fn pool(members: &str) -> String {
    format!("routes:\n  - name: a\n    upstream:\n      members:\n{members}")
}

#[test]
fn connect_is_a_method_routes_may_allow() {
    let config = parse(
        "routes:\n  - name: a\n    match:\n      methods: [GET, connect]\n    upstream: {}\n",
    );
    let methods: Vec<_> = config.routes[0]
        .matcher
        .methods
        .iter()
        .map(|m| m.0.as_str())
        .collect();
    assert_eq!(methods, ["GET", "CONNECT"]);
}

#[test]
fn members_are_origins_proxies_or_direct() {
    let config = parse(&pool(
        "        - proxy: \"http://us%40r:p%3Ass@Proxy.Test:3128\"\n        - proxy: \"http://10.0.0.6:3128/\"\n        - direct: true\n",
    ));
    let m = &config.routes[0].upstream.members;
    assert_eq!(
        m[0].url.url, "http://proxy.test:3128",
        "no credentials in the identity"
    );
    assert_eq!(
        (m[0].url.host.as_str(), m[0].url.port),
        ("proxy.test", 3128)
    );
    match &m[0].kind {
        MemberKind::Proxy {
            authorization: Some(v),
        } => {
            // base64("us@r:p:ss")
            assert_eq!(v.to_str().unwrap(), "Basic dXNAcjpwOnNz");
            assert!(v.is_sensitive());
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(
        m[1].kind,
        MemberKind::Proxy {
            authorization: None
        }
    );
    assert_eq!(m[1].url.url, "http://10.0.0.6:3128");
    assert_eq!(m[2].kind, MemberKind::Direct);
    assert_eq!(m[2].url.url, "direct");
    let shown = format!("{:?}", config.routes[0].upstream);
    assert!(
        !shown.contains("p:ss") && !shown.contains("dXNAcjpwOnNz"),
        "{shown}"
    );
}

#[test]
fn a_proxy_password_can_come_from_the_environment() {
    // The one test through the real environment. `set_var` races with other threads reading
    // the environment (it is `unsafe` from edition 2024 on; this crate is 2021), so the name is
    // this test's own and nothing else reads it; the tests below pass a map instead.
    std::env::set_var("SLUICE_TEST_PROXY_PASS", "s3cret");
    let config = parse(&pool(
        "        - proxy: \"http://user:${SLUICE_TEST_PROXY_PASS}@127.0.0.1:3128\"\n",
    ));
    let MemberKind::Proxy {
        authorization: Some(v),
    } = &config.routes[0].upstream.members[0].kind
    else {
        panic!("a proxy with credentials")
    };
    assert_eq!(
        v.to_str().unwrap(),
        format!("Basic {}", base64(b"user:s3cret"))
    );
    // Shown at its `${`, not at the scalar.
    one_error(
        &pool("        - proxy: \"http://user:${SLUICE_TEST_UNSET_VAR}@127.0.0.1:3128\"\n"),
        "5:31: routes[0].upstream.members[0].proxy",
        "environment variable SLUICE_TEST_UNSET_VAR is not set",
    );
}

// `${NAME}` (SPEC §8). The rewriting itself is tested in `interpolate`; these go through
// `Config::parse`, with a map for the environment so that tests running in parallel share no
// process state.

/// `Config::parse` with `vars` as the whole environment.
pub(super) fn parse_env(yaml: &str, vars: &[(&str, &str)]) -> Result<Config, Vec<String>> {
    let env = |name: &str| {
        vars.iter()
            .find(|(k, _)| *k == name)
            .map(|(_, v)| v.to_string())
            .ok_or(std::env::VarError::NotPresent)
    };
    Config::parse_with_env("t.yaml", yaml, &env).map_err(|ConfigErrors(all)| {
        all.iter()
            .map(|e| format!("{}:{}: {}: {}", e.line, e.column, e.path, e.message))
            .collect()
    })
}

#[test]
fn variables_reach_every_kind_of_value() {
    let yaml = "threads: ${THREADS}
routes:
  - name: ${NAME:-fallback}
    match:
      hosts: [\"${HOST}\", \"api.${DOMAIN:-example.com}\"]
      path_prefix: '/${PREFIX}/$${literal}/'
    upstream:
      members:
        - url: \"http://${HOST}:${PORT}\"
    quota:
      windows:
        - name: rpm
          limit: ${LIMIT}
          window: \"${WINDOW:-1m}\"
";
    let vars = [
        ("THREADS", "3"),
        ("HOST", "a.test"),
        ("DOMAIN", ""),
        ("PREFIX", "v1"),
        ("PORT", "9001"),
        ("LIMIT", "60"),
    ];
    let config = parse_env(yaml, &vars).unwrap_or_else(|e| panic!("{e:#?}"));
    assert_eq!(config.threads.map(|n| n.get()), Some(3));
    let route = &config.routes[0];
    assert_eq!(route.name.0, "fallback");
    let hosts: Vec<String> = route
        .matcher
        .hosts
        .iter()
        .map(|h| format!("{h:?}"))
        .collect();
    assert_eq!(hosts.len(), 2, "{hosts:?}");
    assert!(hosts[0].contains("a.test"), "{hosts:?}");
    // An empty variable takes its default, as `:-` does in a shell.
    assert!(hosts[1].contains("api.example.com"), "{hosts:?}");
    assert_eq!(route.matcher.path_prefix.0, "/v1/${literal}/");
    assert_eq!(route.upstream.members[0].url.url, "http://a.test:9001");
    let window = &route.quota.as_ref().unwrap().windows[0];
    assert_eq!(window.limit.get(), 60);
    assert_eq!(
        window.window.sliding(),
        Some(std::time::Duration::from_secs(60))
    );
}

#[test]
fn every_unset_variable_is_an_error_at_its_dollar() {
    let yaml = "threads: ${SLUICE_T_THREADS}
routes:
  - name: a
    match: { hosts: [\"${SLUICE_T_HOST}\", \"b.${SLUICE_T_SET}.${SLUICE_T_DOMAIN}\"] }
    upstream: {}
";
    assert_eq!(
        parse_env(yaml, &[("SLUICE_T_SET", "x")]).unwrap_err(),
        [
            "1:10: threads: environment variable SLUICE_T_THREADS is not set (write `${SLUICE_T_THREADS:-default}` for a default)",
            "4:23: routes[0].match.hosts[0]: environment variable SLUICE_T_HOST is not set (write `${SLUICE_T_HOST:-default}` for a default)",
            "4:61: routes[0].match.hosts[1]: environment variable SLUICE_T_DOMAIN is not set (write `${SLUICE_T_DOMAIN:-default}` for a default)",
        ]
    );
}

#[test]
fn bad_names_and_unterminated_dollars_are_errors() {
    let all = parse_env(
        "routes:\n  - name: \"${1ST}\"\n    match: {path_prefix: \"/${A-B}\"}\n    upstream: {members: [{url: \"http://${HOST\"}]}\n",
        &[("HOST", "h")],
    )
    .unwrap_err();
    assert_eq!(all.len(), 3, "{all:#?}");
    assert!(
        all[0].starts_with("2:12: routes[0].name: `${1ST}` is not `${NAME}`"),
        "{all:#?}"
    );
    assert!(
        all[1].starts_with("3:28: routes[0].match.path_prefix: `${A-B}` is not `${NAME}`"),
        "{all:#?}"
    );
    assert!(
        all[2].starts_with("4:40: routes[0].upstream.members[0].url: unterminated `${`"),
        "{all:#?}"
    );
}

#[test]
fn a_value_stays_one_string_whatever_it_holds() {
    // A value that, pasted into the text, would end the string and add a route and a setting.
    let evil = "/x\"\n  - name: injected\n    upstream: {}\nadmin: {listen: \"0.0.0.0:9901\"} #";
    for yaml in [
        "routes:\n  - name: a\n    match: {path_prefix: \"${EVIL}\"}\n    upstream: {}\n",
        "routes:\n  - name: a\n    match:\n      path_prefix: ${EVIL}\n    upstream: {}\n",
    ] {
        let config = parse_env(yaml, &[("EVIL", evil)]).unwrap_or_else(|e| panic!("{e:#?}"));
        assert_eq!(config.routes.len(), 1);
        assert_eq!(config.routes[0].matcher.path_prefix.0, evil);
        assert_eq!(config.admin, AdminConfig::default());
    }
}

#[test]
fn proxy_credentials_from_a_variable_may_hold_at_signs_and_colons() {
    let yaml = pool("        - proxy: \"http://user:${PASS}@127.0.0.1:3128\"\n");
    let config = parse_env(&yaml, &[("PASS", "p@ss:w0rd")]).unwrap_or_else(|e| panic!("{e:#?}"));
    let MemberKind::Proxy {
        authorization: Some(v),
    } = &config.routes[0].upstream.members[0].kind
    else {
        panic!("a proxy with credentials")
    };
    assert_eq!(
        v.to_str().unwrap(),
        format!("Basic {}", base64(b"user:p@ss:w0rd"))
    );
}

#[test]
fn a_number_in_a_flow_collection() {
    let yaml = "routes:\n  - name: a\n    upstream: {}\n    quota: {windows: [{name: w, limit: ${LIMIT}, window: 1s}]}\n";
    let config = parse_env(yaml, &[("LIMIT", "60")]).unwrap_or_else(|e| panic!("{e:#?}"));
    assert_eq!(
        config.routes[0].quota.as_ref().unwrap().windows[0]
            .limit
            .get(),
        60
    );
    // A refused value is shown at its `${` in the file.
    assert_eq!(
        parse_env(yaml, &[("LIMIT", "0")]).unwrap_err(),
        ["4:40: routes[0].quota.windows[0].limit: invalid value: integer `${LIMIT}`, expected a nonzero u64"]
    );
}

#[test]
fn errors_point_into_the_file_as_written() {
    // The window's name is much longer than `${W}`; the limit is still shown where the file
    // has it.
    let all = parse_env(
        "routes:\n  - name: a\n    upstream: {}\n    quota:\n      windows: [{name: \"${W}\", limit: 0, window: 1s}]\n",
        &[("W", "a-window-with-a-very-long-name")],
    )
    .unwrap_err();
    assert_eq!(all.len(), 1, "{all:#?}");
    assert!(
        all[0].starts_with("5:39: routes[0].quota.windows[0].limit: "),
        "{all:#?}"
    );
}

#[test]
fn an_interpolated_secret_never_appears_in_an_error() {
    let secret = "s3cr3t-Value";
    // Each field echoes the value it refuses.
    let yaml = "threads: \"${SLUICE_T_SECRET}\"
routes:
  - name: \"key ${SLUICE_T_SECRET}\"
    upstream: {}
  - name: b
    match: { path_prefix: \"${SLUICE_T_SECRET}\" }
    upstream: {}
  - name: c
    upstream:
      members:
        - url: \"ftp://${SLUICE_T_SECRET}.test\"
  - name: d
    upstream:
      members:
        - url: \"https://x.test/${SLUICE_T_SECRET}\"
";
    let all = parse_env(yaml, &[("SLUICE_T_SECRET", secret)]).unwrap_err();
    assert_eq!(all.len(), 5, "{all:#?}");
    for e in &all {
        assert!(!e.to_lowercase().contains("s3cr3t"), "{e}");
    }
    assert!(
        all.iter().any(|e| e.contains("${SLUICE_T_SECRET}")),
        "{all:#?}"
    );
    // A rule across fields quotes the member as kept: its host in lowercase.
    let all = parse_env(
        &pool("        - url: \"http://${SLUICE_T_SECRET}.test\"\n        - url: \"http://${SLUICE_T_SECRET}.test\"\n"),
        &[("SLUICE_T_SECRET", secret)],
    )
    .unwrap_err();
    assert_eq!(
        all,
        ["6:16: routes[0].upstream.members[1].url: duplicate member \"http://${SLUICE_T_SECRET}.test\" in this pool: members[0] is the same (two members on one address need a name each)"]
    );
}

#[test]
fn bad_members_are_shown_at_the_member() {
    let at = "5:11: routes[0].upstream.members[0]";
    one_error(
        &pool("        - weight: 2\n"),
        at,
        "a member needs one of url, proxy or direct: true",
    );
    one_error(
        &pool("        - direct: false\n"),
        at,
        "direct: false is not a member",
    );
    one_error(
        &pool("        - url: \"http://a.test\"\n          direct: true\n"),
        at,
        "not several",
    );
    one_error(
        &pool("        - url: \"http://a.test\"\n          proxy: \"http://b.test:3128\"\n"),
        at,
        "not several",
    );
    one_error(
        &pool("        - direct: yes please\n"),
        "5:19: routes[0].upstream.members[0].direct",
        "invalid type",
    );
    one_error(
        &pool("        - drect: true\n"),
        "5:11: routes[0].upstream.members[0].drect",
        "unknown field",
    );
}

#[test]
fn bad_proxy_urls_never_show_the_password() {
    let at = "5:18: routes[0].upstream.members[0].proxy";
    for (url, message) in [
        (
            "https://u:hunter2@p.test:3128",
            "an https:// proxy is not supported yet",
        ),
        (
            "socks5://u:hunter2@p.test:1080",
            "expected http://[user:password@]host:port",
        ),
        ("http://u:hunter2@p.test", "give the proxy's port"),
        (
            "http://u:hunter2@:3128",
            "expected http://[user:password@]host:port",
        ),
        (
            "http://u:hunter2@p.test:3128/path",
            "expected http://[user:password@]host:port",
        ),
    ] {
        let all = errors(&pool(&format!("        - proxy: \"{url}\"\n")));
        assert!(
            all.len() == 1 && all[0].starts_with(at) && all[0].contains(message),
            "{url}: {all:#?}"
        );
        assert!(!all[0].contains("hunter2"), "{}", all[0]);
        assert!(
            all[0].contains("u:***@p.test") || all[0].contains("***@"),
            "{}",
            all[0]
        );
    }
}

#[test]
fn a_pool_does_not_mix_origins_with_proxy_or_direct_members() {
    one_error(
        &pool("        - url: \"http://a.test\"\n        - direct: true\n"),
        "6:11: routes[0].upstream.members[1]",
        "a pool holds origins (url) only, or proxy and direct members only: members[0] is an origin (url)",
    );
    one_error(
        &pool("        - proxy: \"http://p.test:3128\"\n        - url: \"http://a.test\"\n"),
        "6:11: routes[0].upstream.members[1]",
        "members[0] is a proxy or direct member",
    );
    // Proxies and direct members mix: both reach the client's target.
    parse(&pool(
        "        - proxy: \"http://p.test:3128\"\n        - direct: true\n",
    ));
    one_error(
        &pool("        - direct: true\n        - direct: true\n"),
        "6:19: routes[0].upstream.members[1].direct",
        "duplicate member \"direct\"",
    );
}

// TLS listeners (`listen[].tls`).

/// A directory holding `cert.pem` with `key.pem` (its key), `other.key` (another key) and
/// `garbage.key` (a PEM key section whose body is not base64), made once with `openssl`.
fn tls_files() -> &'static std::path::Path {
    static DIR: std::sync::OnceLock<std::path::PathBuf> = std::sync::OnceLock::new();
    DIR.get_or_init(|| {
        let dir = std::env::temp_dir().join(format!("sluice-config-tls-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let openssl = |args: &[&str]| {
            let out = std::process::Command::new("openssl")
                .args(args)
                .current_dir(&dir)
                .output()
                .expect("openssl must be installed");
            assert!(out.status.success(), "openssl {args:?}: {out:?}");
        };
        let ec = [
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
        ];
        let mut req = vec!["req", "-x509", "-days", "1", "-subj", "/CN=sluice"];
        req.extend(ec);
        req.extend(["-keyout", "key.pem", "-out", "cert.pem"]);
        openssl(&req);
        openssl(&[
            "genpkey",
            "-algorithm",
            "EC",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-out",
            "other.key",
        ]);
        std::fs::write(
            dir.join("garbage.key"),
            "-----BEGIN PRIVATE KEY-----\nSECRET-MATERIAL!!\n-----END PRIVATE KEY-----\n",
        )
        .unwrap();
        dir
    })
}

/// `listen:` with one TLS listener on 127.0.0.1:8443 using `cert` and `key` in [`tls_files`].
fn tls_listen(cert: &str, key: &str) -> String {
    let dir = tls_files().display();
    format!(
        "listen:\n  - \"127.0.0.1:8080\"\n  - addr: \"127.0.0.1:8443\"\n    tls:\n      cert: {dir}/{cert}\n      key: {dir}/{key}\nroutes: []\n"
    )
}

#[test]
fn a_listen_entry_is_an_address_or_a_mapping_with_tls() {
    let config = parse(&tls_listen("cert.pem", "key.pem"));
    assert_eq!(
        config.listen[0],
        Listener::plain("127.0.0.1:8080".parse().unwrap())
    );
    let tls = config.listen[1].tls.as_ref().expect("tls");
    assert_eq!(config.listen[1].addr, "127.0.0.1:8443".parse().unwrap());
    assert_eq!(tls.cert, tls_files().join("cert.pem"));
    assert_eq!(tls.key, tls_files().join("key.pem"));
    // The mapping without tls is a plain listener.
    let config = parse("listen: [{addr: \"[::1]:8080\"}]\nroutes: []\n");
    assert_eq!(
        config.listen,
        [Listener::plain("[::1]:8080".parse().unwrap())]
    );
}

#[test]
fn tls_listener_mistakes_are_placed_at_the_entry() {
    one_error(
        "listen:\n  - addr: \"127.0.0.1\"\nroutes: []\n",
        "2:11: listen[0].addr",
        "invalid listen address \"127.0.0.1\"",
    );
    one_error(
        "listen: [{addr: \"127.0.0.1:8443\", tsl: {}}]\nroutes: []\n",
        "1:35: listen[0].tsl",
        "unknown field `tsl`, expected `addr` or `tls`",
    );
    one_error(
        "listen: [{addr: \"127.0.0.1:8443\", tls: {cert: c.pem}}]\nroutes: []\n",
        "1:40: listen[0].tls",
        "missing field `key`",
    );
    one_error(
        "listen: [7]\nroutes: []\n",
        "1:10: listen[0]",
        "expected an address IP:PORT, or a mapping",
    );
    // Cross-field rules see the address of a mapping entry too.
    one_error(
        "listen: [\"127.0.0.1:8443\", {addr: \"127.0.0.1:8443\"}]\nroutes: []\n",
        "1:28: listen[1]",
        "127.0.0.1:8443 is already listen[0]",
    );
}

#[test]
fn tls_listener_files_are_checked_and_named() {
    let dir = tls_files().display().to_string();
    one_error(
        &tls_listen("cert.pem", "missing.key"),
        "6:12: listen[1].tls.key",
        &format!("cannot read {dir}/missing.key: No such file or directory"),
    );
    one_error(
        &tls_listen("missing.pem", "key.pem"),
        "5:13: listen[1].tls.cert",
        &format!("cannot read {dir}/missing.pem"),
    );
    // Each file holds the wrong thing.
    one_error(
        &tls_listen("key.pem", "key.pem"),
        "5:13: listen[1].tls.cert",
        &format!("{dir}/key.pem: no certificate in it"),
    );
    one_error(
        &tls_listen("cert.pem", "cert.pem"),
        "6:12: listen[1].tls.key",
        &format!("{dir}/cert.pem: no private key in it"),
    );
    one_error(
        &tls_listen("cert.pem", "other.key"),
        "5:7: listen[1].tls",
        &format!(
            "the key in {dir}/other.key is not the key of the first certificate in {dir}/cert.pem"
        ),
    );
}

/// [`tls_listen`] with `client_ca` (a file in [`tls_files`]) and `client_cert` (when given).
fn tls_listen_with_client_ca(client_ca: &str, client_cert: Option<&str>) -> String {
    let dir = tls_files().display();
    let mut yaml = tls_listen("cert.pem", "key.pem").replace(
        "routes: []\n",
        &format!("      client_ca: {dir}/{client_ca}\n"),
    );
    if let Some(mode) = client_cert {
        yaml.push_str(&format!("      client_cert: {mode}\n"));
    }
    yaml + "routes: []\n"
}

#[test]
fn a_client_ca_is_read_and_client_cert_defaults_to_required() {
    let config = parse(&tls_listen_with_client_ca("cert.pem", None));
    let tls = config.listen[1].tls.as_ref().expect("tls");
    assert_eq!(
        tls.client_ca.as_deref(),
        Some(&*tls_files().join("cert.pem"))
    );
    assert_eq!(tls.client_cert, ClientCertMode::Required);
    let config = parse(&tls_listen_with_client_ca("cert.pem", Some("optional")));
    let tls = config.listen[1].tls.as_ref().expect("tls");
    assert_eq!(tls.client_cert, ClientCertMode::Optional);
}

#[test]
fn an_unreadable_client_ca_is_named_at_its_key() {
    let dir = tls_files().display().to_string();
    one_error(
        &tls_listen_with_client_ca("missing-ca.pem", None),
        "7:18: listen[1].tls.client_ca",
        &format!("cannot read {dir}/missing-ca.pem: No such file or directory"),
    );
    one_error(
        &tls_listen_with_client_ca("key.pem", Some("optional")),
        "7:18: listen[1].tls.client_ca",
        &format!("{dir}/key.pem: no certificate in it"),
    );
    one_error(
        &tls_listen_with_client_ca("garbage.key", None),
        "7:18: listen[1].tls.client_ca",
        &format!("{dir}/garbage.key: not a PEM certificate chain"),
    );
}

#[test]
fn a_bad_key_file_is_never_quoted() {
    let all = errors(&tls_listen("cert.pem", "garbage.key"));
    assert_eq!(all.len(), 1, "{all:#?}");
    assert!(
        all[0].starts_with("6:12: listen[1].tls.key: "),
        "{}",
        all[0]
    );
    assert!(
        all[0].contains("garbage.key: not a readable PEM file"),
        "{}",
        all[0]
    );
    assert!(!all[0].contains("SECRET"), "{}", all[0]);
}

#[test]
fn connect_health_checks_are_for_proxy_pools_and_need_a_target() {
    let proxy = "routes:\n  - name: a\n    upstream:\n      members: [{proxy: \"http://u:p@127.0.0.1:3128\"}]\n";
    let origin =
        "routes:\n  - name: a\n    upstream:\n      members: [{url: \"http://127.0.0.1:80\"}]\n";
    let config = parse(&format!(
        "{proxy}      health_check: {{kind: connect, target: \"example.com:443\"}}\n"
    ));
    let check = config.routes[0].upstream.health_check.as_ref().unwrap();
    assert_eq!(check.kind, CheckKind::Connect);
    assert_eq!(check.target.as_deref(), Some("example.com:443"));
    parse(&format!(
        "{proxy}      health_check: {{kind: connect, target: \"[2001:db8::1]:443\"}}\n"
    ));
    one_error(
        &format!("{proxy}      health_check: {{kind: connect}}\n"),
        "5:28: routes[0].upstream.health_check.kind",
        "needs a target",
    );
    one_error(
        &format!("{proxy}      health_check: {{kind: connect, target: \"example.com\"}}\n"),
        "5:45: routes[0].upstream.health_check.target",
        "is not host:port",
    );
    one_error(
        &format!("{origin}      health_check: {{kind: connect, target: \"example.com:443\"}}\n"),
        "4:17: routes[0].upstream.members[0]",
        "every member of the pool must be a proxy member",
    );
    one_error(
        &format!("{proxy}      health_check: {{kind: tcp, target: \"example.com:443\"}}\n"),
        "5:41: routes[0].upstream.health_check.target",
        "applies to kind: connect only",
    );
    one_error(
        &format!("{proxy}      health_check: {{kind: connect, target: \"a:1\", path: /x}}\n"),
        "5:58: routes[0].upstream.health_check.path",
        "applies to kind: http only",
    );
}

#[test]
fn log_and_tracing_are_off_by_default_and_checked() {
    let config = parse("routes: []\n");
    assert!(!config.log.query);
    assert_eq!(config.tracing.otlp, None);
    let config = parse(
        "log:\n  query: true\ntracing:\n  otlp:\n    endpoint: http://127.0.0.1:4318\nroutes: []\n",
    );
    assert!(config.log.query);
    let otlp = config.tracing.otlp.expect("otlp");
    assert_eq!(otlp.sample_ratio, 1.0);
    assert_eq!(otlp.max_queue.get(), 2048);
    assert_eq!(otlp.service_name, "sluice");
    let all = errors(
        "tracing:\n  otlp:\n    endpoint: https://collector:4318\n    sample_ratio: 1.5\nroutes: []\n",
    );
    assert_eq!(all.len(), 2, "{all:#?}");
    assert!(all[0].contains("tracing.otlp.endpoint") && all[0].contains("only http://"));
    assert!(all[1].contains("tracing.otlp.sample_ratio") && all[1].contains("from 0"));
    let all = errors("tracing:\n  otlp:\n    endpoint: http://u:p@collector:4318\nroutes: []\n");
    assert!(all.len() == 1 && all[0].contains("credentials"), "{all:#?}");
    one_error(
        "log:\n  queries: true\nroutes: []\n",
        "2:3: log.queries",
        "unknown field",
    );
}

/// A Redis URL may hold its password: no debug output of it, or of its config, shows it.
#[test]
fn debug_output_hides_the_password() {
    let url = RedisUrl::parse("redis://sluice:hunter2-secret@127.0.0.1:6379/0").unwrap();
    let config = RedisConfig {
        url: Some(url.clone()),
        cluster: Some(vec![url.clone()]),
        key_prefix: "sluice".into(),
        timeout: Dur(std::time::Duration::from_millis(50)),
        tls: None,
        batch: true,
        instance_index: None,
    };
    for shown in [
        format!("{url:?}"),
        format!("{config:?}"),
        format!("{config:#?}"),
    ] {
        assert!(!shown.contains("hunter2"), "{shown}");
        assert!(shown.contains("redis://***@127.0.0.1:6379/0"), "{shown}");
    }
}
