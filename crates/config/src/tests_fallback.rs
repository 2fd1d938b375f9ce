//! `fallback`: the routes a request goes on to. Each refusal is placed at the node to blame.

use super::tests::{errors, one_error};
use super::*;

/// Routes `a`, `b`, `c` and `d`, each with the YAML lines of its `fallback` (at the route's
/// indent + 4), or none.
fn routes(a: &str, b: &str, c: &str, d: &str) -> String {
    let mut yaml = String::from("routes:\n");
    for (name, fallback) in [("a", a), ("b", b), ("c", c), ("d", d)] {
        yaml.push_str(&format!(
            "  - name: {name}\n    match: {{ hosts: [{name}.test] }}\n    upstream: {{}}\n"
        ));
        if !fallback.is_empty() {
            yaml.push_str(&format!("    fallback:\n{fallback}"));
        }
    }
    yaml
}

#[test]
fn the_contract_example_parses_in_order() {
    let yaml = routes(
        "      - { route: b, on: [quota_exceeded, no_member, 429, 503] }\n      - { route: c, on: [\"429\"] }\n",
        "",
        "",
        "",
    );
    let config = Config::parse("t.yaml", &yaml).unwrap_or_else(|e| panic!("{e}"));
    let fallback = &config.routes[0].fallback;
    assert_eq!(fallback.len(), 2);
    assert_eq!(fallback[0].route.0, "b");
    assert_eq!(
        fallback[0].on,
        [
            FallbackOn::QuotaExceeded,
            FallbackOn::NoMember,
            FallbackOn::TooManyRequests,
            FallbackOn::Unavailable
        ]
    );
    assert_eq!(fallback[1].on, [FallbackOn::TooManyRequests]);
    assert!(config.routes[1].fallback.is_empty(), "none by default");
}

#[test]
fn check_refuses_a_cycle_at_the_entry_that_closes_it() {
    let yaml = routes(
        "      - { route: b, on: [429] }\n",
        "      - { route: a, on: [429] }\n",
        "",
        "",
    );
    let all = errors(&yaml);
    assert_eq!(all.len(), 2, "both entries close the cycle: {all:#?}");
    assert!(
        all[0].starts_with("6:18: routes[0].fallback[0].route: ")
            && all[0].contains("fallback cycle: a -> b -> a"),
        "{all:#?}"
    );
    let own = routes("      - { route: a, on: [429] }\n", "", "", "");
    one_error(
        &own,
        "6:18: routes[0].fallback[0].route",
        "fallback cycle: a -> a",
    );
}

#[test]
fn check_refuses_an_unknown_route() {
    let yaml = routes("      - { route: nope, on: [429] }\n", "", "", "");
    one_error(
        &yaml,
        "6:18: routes[0].fallback[0].route",
        "no route is named \"nope\"",
    );
}

#[test]
fn check_refuses_a_chain_longer_than_three_hops() {
    let three = routes(
        "      - { route: b, on: [429] }\n",
        "      - { route: c, on: [429] }\n",
        "      - { route: d, on: [429] }\n",
        "",
    );
    assert_eq!(
        errors(&three),
        Vec::<String>::new(),
        "a -> b -> c -> d is 3 hops"
    );
    let yaml = format!(
        "{three}  - name: e\n    match: {{ hosts: [e.test] }}\n    upstream: {{}}\n    fallback:\n      - {{ route: a, on: [429] }}\n"
    );
    one_error(
        &yaml,
        "24:18: routes[4].fallback[0].route",
        "is 4 hops long; at most 3 are followed",
    );
}

#[test]
fn check_refuses_statuses_that_do_not_say_the_member_did_no_work() {
    let yaml = routes("      - { route: b, on: [429, 500] }\n", "", "", "");
    one_error(
        &yaml,
        "6:31: routes[0].fallback[0].on[1]",
        "500 cannot send a request on: only 429 and 503",
    );
    let word = routes("      - { route: b, on: [teapot] }\n", "", "", "");
    one_error(
        &word,
        "6:26: routes[0].fallback[0].on[0]",
        "unknown reason \"teapot\"",
    );
    // concurrency_exceeded needs a cap on the route that falls back.
    let uncapped = routes(
        "      - { route: b, on: [concurrency_exceeded] }\n",
        "",
        "",
        "",
    );
    one_error(
        &uncapped,
        "6:26: routes[0].fallback[0].on[0]",
        "needs max_in_flight",
    );
    let empty = routes("      - { route: b, on: [] }\n", "", "", "");
    one_error(&empty, "6:25: routes[0].fallback[0].on", "on is empty");
}
