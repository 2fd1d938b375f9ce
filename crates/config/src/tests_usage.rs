//! Usage-metered quotas: a window's `unit`, calendar windows with `tz`, and `quota.usage` with
//! its reserve and settle amounts. Every refusal is placed at the node to blame.

use std::time::Duration;

use super::tests::{errors, one_error};
use super::*;

fn parse(yaml: &str) -> Config {
    Config::parse("t.yaml", yaml).unwrap_or_else(|e| panic!("{e}"))
}

/// One route whose quota has `windows` and `usage` (each YAML lines at quota's indent + 2).
fn route(windows: &str, usage: &str) -> String {
    format!(
        "routes:\n  - name: r\n    upstream: {{}}\n    quota:\n      windows:\n{windows}{usage}"
    )
}

const TOKENS: &str = "      usage:\n        tokens:\n          reserve: { json: max_tokens, default: 4096 }\n          settle: { json: usage.total_tokens }\n";

const TPM: &str = "        - { name: tpm, limit: 200000, window: 1m, unit: tokens }\n";

#[test]
fn the_contract_example_parses_into_units_and_amounts() {
    let yaml = r#"
routes:
  - name: openai
    upstream: {}
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
    let config = parse(yaml);
    let quota = config.routes[0].quota.as_ref().unwrap();
    let [rpm, tpm, month] = &quota.windows[..] else {
        panic!("{:?}", quota.windows)
    };
    assert_eq!(rpm.unit, WindowUnit::Requests, "requests is the default");
    assert_eq!(rpm.window.sliding(), Some(Duration::from_secs(60)));
    assert_eq!(rpm.calendar(), None);
    assert_eq!(tpm.unit, WindowUnit::Named(UnitName("tokens".into())));
    let (period, tz) = month.calendar().unwrap();
    assert_eq!(period, CalendarPeriod::Month);
    assert_eq!(&*tz.name, "Europe/Paris");
    assert_eq!(month.window.sliding(), None);

    let usage = quota.usage.as_ref().unwrap();
    assert_eq!(usage.max_request_body.get(), 64 * 1024, "the default");
    assert_eq!(usage.max_response_body.get(), 1024 * 1024, "the default");
    assert_eq!(usage.zero_on, [429], "the default");
    assert!(usage.reads_request_body());
    let tokens = usage.unit(&UnitName("tokens".into())).unwrap();
    let Amount::Sum(parts) = &tokens.reserve else {
        panic!("{:?}", tokens.reserve)
    };
    let Amount::Json {
        path,
        default,
        times,
    } = &parts[0]
    else {
        panic!("{parts:?}")
    };
    assert_eq!(
        (&*path.text, *default, *times),
        ("max_tokens", Some(4096.0), 1.0)
    );
    assert_eq!(parts[1], Amount::RequestBytes { times: 0.25 });
    let Amount::Json { path, default, .. } = &tokens.settle else {
        panic!("{:?}", tokens.settle)
    };
    assert_eq!(
        path.keys.iter().map(|k| &**k).collect::<Vec<_>>(),
        ["usage", "total_tokens"]
    );
    assert_eq!(*default, None);
    let usd = usage.unit(&UnitName("usd".into())).unwrap();
    assert_eq!(usd.reserve, Amount::Value(0.10));
    assert!(!usd.reserve.reads_body());
    assert_eq!(usd.settle.leaves().len(), 2);
}

#[test]
fn a_calendar_window_without_tz_is_in_utc_and_counts_requests_as_before() {
    let config = parse(&route(
        "        - { name: day, limit: 1000, window: calendar_day }\n        - { name: week, limit: 5000, window: calendar_week, unit: requests }\n",
        "",
    ));
    let windows = &config.routes[0].quota.as_ref().unwrap().windows;
    let (period, tz) = windows[0].calendar().unwrap();
    assert_eq!((period, &*tz.name), (CalendarPeriod::Day, "UTC"));
    assert_eq!(windows[1].calendar().unwrap().0, CalendarPeriod::Week);
    assert_eq!(windows[1].unit, WindowUnit::Requests);
}

#[test]
fn settings_of_usage_are_read_beside_the_units() {
    let usage = "      usage:\n        max_request_body: 1024\n        max_response_body: 4096\n        zero_on: [429, 503]\n        tokens:\n          reserve: { value: 10 }\n          settle: { header: X-Tokens-Used, times: 2 }\n";
    let config = parse(&route(TPM, usage));
    let usage = config.routes[0]
        .quota
        .as_ref()
        .unwrap()
        .usage
        .clone()
        .unwrap();
    assert_eq!(usage.max_request_body.get(), 1024);
    assert_eq!(usage.max_response_body.get(), 4096);
    assert_eq!(usage.zero_on, [429, 503]);
    assert!(
        !usage.reads_request_body(),
        "a fixed reservation reads no body"
    );
    assert_eq!(
        usage.units[0].settle,
        Amount::Header {
            name: http::HeaderName::from_static("x-tokens-used"),
            times: 2.0
        }
    );
}

#[test]
fn members_and_clients_count_in_the_routes_units() {
    let yaml = r#"
clients:
  list:
    - name: team
      tokens: ["0123456789abcdef"]
      routes: ["*"]
      quota: { windows: [{ name: daily-tokens, limit: 1000000, window: 1d, unit: tokens }] }
routes:
  - name: llm
    upstream:
      selection: least_used
      members:
        - url: "https://api.test"
          name: key-a
          quota: { windows: [{ name: tpm, limit: 30000, window: 1m, unit: tokens }] }
    quota:
      windows: []
      usage:
        tokens:
          reserve: { json: max_tokens, default: 1000 }
          settle: { json: usage.total_tokens }
        credits:
          reserve: { value: 1 }
          settle: { header: x-credits }
"#;
    // No window counts `credits`: the one problem.
    assert_eq!(
        errors(yaml),
        ["23:11: routes[0].quota.usage.credits: unit \"credits\" is counted by no window: give a window unit: credits, or leave the unit out"]
    );
    let fine = yaml.replace(
        "unit: tokens }] }\nroutes",
        "unit: tokens }, { name: c, limit: 10, window: 1d, unit: credits }] }\nroutes",
    );
    let config = parse(&fine);
    let member = &config.routes[0].upstream.members[0];
    assert_eq!(
        member.quota.as_ref().unwrap().windows[0].unit,
        WindowUnit::Named(UnitName("tokens".into()))
    );
}

#[test]
fn a_unit_no_window_counts_is_refused() {
    one_error(
        &route("        - { name: rpm, limit: 5, window: 1m }\n", TOKENS),
        "9:11: routes[0].quota.usage.tokens",
        "unit \"tokens\" is counted by no window",
    );
}

#[test]
fn a_window_in_an_undefined_unit_is_refused() {
    one_error(
        &route(TPM, ""),
        "6:57: routes[0].quota.windows[0].unit",
        "unit \"tokens\" is not defined: define it under this route's quota.usage",
    );
    // A member's window, on a route that defines no units at all.
    let yaml = "routes:\n  - name: r\n    upstream:\n      members:\n        - url: \"https://a.test\"\n          quota: { windows: [{ name: m, limit: 10, window: calendar_month, unit: usd }] }\n";
    one_error(
        yaml,
        "6:82: routes[0].upstream.members[0].quota.windows[0].unit",
        "unit \"usd\" is not defined",
    );
    let yaml = "clients:\n  list:\n    - name: c\n      tokens: [\"0123456789abcdef\"]\n      routes: [\"*\"]\n      quota: { windows: [{ name: d, limit: 9, window: 1d, unit: tokens }] }\nroutes:\n  - name: r\n    upstream: {}\n";
    one_error(
        yaml,
        "6:65: clients.list[0].quota.windows[0].unit",
        "unit \"tokens\" is defined by no route",
    );
}

#[test]
fn a_json_path_must_be_dotted_keys() {
    for bad in [
        "usage..total",
        "choices[0].usage",
        ".usage",
        "usage.",
        "",
        "a.*",
        "$.usage",
        "a b",
        // YAML escapes: a tab, and a control character.
        "a\\tb",
        "a\\x01b",
    ] {
        let usage = format!(
            "      usage:\n        tokens:\n          reserve: {{ value: 1 }}\n          settle: {{ json: \"{bad}\" }}\n"
        );
        one_error(
            &route(TPM, &usage),
            "10:27: routes[0].quota.usage.tokens.settle.json",
            "invalid json path",
        );
    }
}

#[test]
fn amounts_are_finite_and_not_negative() {
    for (amount, message) in [
        ("{ value: -1 }", "-1 is not an amount"),
        ("{ value: .nan }", "NaN is not an amount"),
        ("{ value: .inf }", "inf is not an amount"),
        ("{ value: 1e12 }", "is too large"),
        ("{ json: max_tokens, default: -5 }", "-5 is not an amount"),
        (
            "{ request_bytes: true, times: -0.25 }",
            "times -0.25 is not a factor",
        ),
        (
            "{ request_bytes: true, times: .inf }",
            "times inf is not a factor",
        ),
        (
            "{ json: a, default: 1, times: .nan }",
            "times NaN is not a factor",
        ),
    ] {
        let usage = format!(
            "      usage:\n        tokens:\n          reserve: {amount}\n          settle: {{ json: usage.total_tokens }}\n"
        );
        let all = errors(&route(TPM, &usage));
        assert!(
            all.len() == 1
                && all[0].starts_with("9:")
                && all[0].contains("routes[0].quota.usage.tokens.reserve")
                && all[0].contains(message),
            "{amount}: {all:#?}"
        );
    }
}

#[test]
fn an_amount_is_one_thing_readable_where_it_is_used() {
    for (reserve, settle, at, message) in [
        (
            "{ value: 1, json: a }",
            "{ value: 1 }",
            "9:20: routes[0].quota.usage.tokens.reserve",
            "exactly one of",
        ),
        (
            "{ value: 1, default: 2 }",
            "{ value: 1 }",
            "9:20: routes[0].quota.usage.tokens.reserve",
            "default applies to {json: PATH} only",
        ),
        (
            "{ value: 1, times: 2 }",
            "{ value: 1 }",
            "9:20: routes[0].quota.usage.tokens.reserve",
            "times applies to json, request_bytes and header",
        ),
        (
            "{ request_bytes: false }",
            "{ value: 1 }",
            "9:20: routes[0].quota.usage.tokens.reserve",
            "request_bytes: false is not an amount",
        ),
        (
            "{ sum: [] }",
            "{ value: 1 }",
            "9:20: routes[0].quota.usage.tokens.reserve",
            "sum needs at least one part",
        ),
        (
            "{ value: 1, colour: red }",
            "{ value: 1 }",
            "9:32: routes[0].quota.usage.tokens.reserve.colour",
            "unknown field `colour`",
        ),
        (
            "{ json: max_tokens }",
            "{ value: 1 }",
            "9:20: routes[0].quota.usage.tokens.reserve",
            "a reservation's json needs a default",
        ),
        (
            "{ sum: [{ value: 1 }, { header: x-n }] }",
            "{ value: 1 }",
            "9:52: routes[0].quota.usage.tokens.reserve.sum[1].header",
            "header reads a response header",
        ),
        (
            "{ value: 1 }",
            "{ request_bytes: true }",
            "10:36: routes[0].quota.usage.tokens.settle.request_bytes",
            "request_bytes estimates a reservation",
        ),
        (
            "{ value: 1 }",
            "{ header: \"bad header\" }",
            "10:19: routes[0].quota.usage.tokens.settle",
            "invalid header name",
        ),
    ] {
        let usage = format!(
            "      usage:\n        tokens:\n          reserve: {reserve}\n          settle: {settle}\n"
        );
        one_error(&route(TPM, &usage), at, message);
    }
}

#[test]
fn tz_needs_a_calendar_window_and_a_known_zone() {
    one_error(
        &route("        - { name: d, limit: 5, window: 1d, tz: UTC }\n", ""),
        "6:48: routes[0].quota.windows[0].tz",
        "tz applies to calendar windows only",
    );
    one_error(
        &route(
            "        - { name: d, limit: 5, window: calendar_day, tz: Mars/Olympus_Mons }\n",
            "",
        ),
        "6:58: routes[0].quota.windows[0].tz",
        "unknown time zone \"Mars/Olympus_Mons\"",
    );
    one_error(
        &route(
            "        - { name: d, limit: 5, window: calendar_year }\n",
            "",
        ),
        "6:40: routes[0].quota.windows[0].window",
        "unknown calendar window \"calendar_year\"",
    );
    // Sliding windows keep their own checks.
    one_error(
        &route("        - { name: d, limit: 5, window: 0s }\n", ""),
        "6:40: routes[0].quota.windows[0].window",
        "it must be greater than zero",
    );
}

#[test]
fn usage_settings_and_unit_names_have_bounds() {
    for (usage, at, message) in [
        ("      usage:\n        max_request_body: 65537\n", "8:27: routes[0].quota.usage.max_request_body", "is too large: at most 65536 bytes"),
        ("      usage:\n        max_response_body: 16777217\n", "8:28: routes[0].quota.usage.max_response_body", "is too large: at most 16777216 bytes"),
        ("      usage:\n        max_response_body: 0\n", "8:28: routes[0].quota.usage.max_response_body", "nonzero"),
        ("      usage:\n        zero_on: [429, 700]\n", "8:24: routes[0].quota.usage.zero_on[1]", "700 is not an HTTP status"),
        ("      usage:\n        requests: { reserve: { value: 1 }, settle: { value: 1 } }\n", "8:9: routes[0].quota.usage", "\"requests\" cannot name a usage unit"),
        ("      usage:\n        tokens: { reserve: { value: 1 }, settle: { value: 1 } }\n        tokens: { reserve: { value: 2 }, settle: { value: 2 } }\n", "8:9: routes[0].quota.usage", "duplicate entry with key \"tokens\""),
    ] {
        let full = if usage.contains("tokens:") {
            usage.to_string()
        } else {
            format!("{usage}        tokens: {{ reserve: {{ value: 1 }}, settle: {{ value: 1 }} }}\n")
        };
        let all = errors(&route(TPM, &full));
        assert!(
            all.len() == 1 && all[0].starts_with(&format!("{at}: ")) && all[0].contains(message),
            "{usage}: expected `{at}…{message}…`, got {all:#?}"
        );
    }
    one_error(
        &route(
            "        - { name: r, limit: 5, window: 1m }\n",
            "      usage: { zero_on: [429] }\n",
        ),
        "7:14: routes[0].quota.usage",
        "usage defines no unit",
    );
    one_error(
        &route(
            "        - { name: t, limit: 10000000000, window: 1m, unit: tokens }\n",
            TOKENS,
        ),
        "6:29: routes[0].quota.windows[0].limit",
        "too large for a window in a usage unit",
    );
}

#[test]
fn cost_is_checked_against_request_windows_only() {
    // A cost of 100 fits the requests window; the token window's small limit is in tokens.
    let windows = "        - { name: rpm, limit: 100, window: 1m }\n        - { name: tpm, limit: 50, window: 1m, unit: tokens }\n";
    let cost = "      cost: { default: 100 }\n";
    parse(&route(windows, &format!("{cost}{TOKENS}")));
    one_error(
        &route(
            windows,
            &format!("      cost: {{ default: 101 }}\n{TOKENS}"),
        ),
        "8:24: routes[0].quota.cost.default",
        "exceeds the smallest window limit 100",
    );
}
