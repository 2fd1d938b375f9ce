//! `clients:` (SPEC §9), a route's `client_token`, `quota.key: client` and a TLS listener's
//! client certificates. Errors come out as `LINE:COL: PATH: message`, at the node to blame,
//! and never show a token.

use super::tests::{errors, one_error, parse_env};
use super::*;

const ROUTES: &str = "routes:
  - name: openai
    match: { hosts: [api.openai.com] }
    client_token: Authorization
    upstream: {}
  - name: stripe
    match: { hosts: [\"*.stripe.com\"] }
    upstream: { members: [{ direct: true }] }
";

fn with_clients(clients: &str) -> String {
    format!("{ROUTES}clients:\n{clients}")
}

#[test]
fn a_full_clients_section() {
    let yaml = with_clients(
        "  mode: report
  unknown: anonymous
  trusted_proxies: [\"10.9.0.0/24\"]
  failed_auth: { limit: 5, window: 30s }
  list:
    - name: billing
      tokens: [\"billing-token-0123456789\"]
      certs: [\"spiffe://corp.example/ns/billing/sa/api\", \"Billing.Corp.Example\"]
      cidrs: [\"10.1.0.0/16\"]
      routes: [openai, stripe]
      destinations: [\"*.stripe.com\", \"api.github.com:443\", \"[2001:db8::1]:8443\", \"2001:db8::2\"]
      quota: { windows: [{ name: daily, limit: 20000, window: 1d }] }
    - name: anonymous
      routes: [\"*\"]
    - name: batch
      cidrs: [\"10.2.0.0/16\"]
",
    );
    let config = Config::parse("t.yaml", &yaml).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(
        config.routes[0].client_token.as_ref().map(|h| h.as_str()),
        Some("authorization")
    );
    let clients = config.clients.as_ref().unwrap();
    assert_eq!(clients.mode, ClientsMode::Report);
    assert_eq!(clients.unknown, UnknownClients::Anonymous);
    assert_eq!(clients.failed_auth.limit.get(), 5);
    assert_eq!(clients.failed_auth.window.0.as_secs(), 30);
    assert_eq!(clients.failed_auth.cooldown.0.as_secs(), 300, "the default");
    assert_eq!(clients.failed_auth.max_sources.get(), 65_536, "the default");
    let billing = &clients.list[0];
    assert_eq!(billing.tokens[0].0, "billing-token-0123456789");
    assert_eq!(
        billing.certs[1].0, "billing.corp.example",
        "DNS names lowercased"
    );
    assert_eq!(
        billing.routes,
        [
            RouteGrant::Route(RouteName("openai".into())),
            RouteGrant::Route(RouteName("stripe".into()))
        ]
    );
    assert_eq!(
        billing.destinations[0],
        Destination {
            host: HostPattern::Wildcard("stripe.com".into()),
            port: None
        }
    );
    assert_eq!(billing.destinations[1].port.map(|p| p.get()), Some(443));
    assert_eq!(
        billing.destinations[2],
        Destination {
            host: HostPattern::Exact("2001:db8::1".into()),
            port: std::num::NonZeroU16::new(8443)
        }
    );
    assert_eq!(billing.destinations[3].port, None);
    assert!(!billing.address_only());
    assert_eq!(clients.list[1].routes, [RouteGrant::All]);
    assert!(clients.list[2].address_only());
    // Debug, which any log of the config would use, never shows a token.
    let shown = format!("{config:?}");
    assert!(!shown.contains("billing-token"), "{shown}");
}

#[test]
fn defaults_without_a_clients_section_and_with_an_empty_one() {
    let config = Config::parse("t.yaml", "routes: []\n").unwrap();
    assert_eq!(config.clients, None);
    let config = Config::parse("t.yaml", "routes: []\nclients: {}\n").unwrap();
    let clients = config.clients.unwrap();
    assert_eq!(clients.mode, ClientsMode::Enforce);
    assert_eq!(clients.unknown, UnknownClients::Deny);
    assert_eq!(clients.failed_auth, FailedAuthConfig::default());
    assert_eq!(clients.failed_auth.limit.get(), 20);
    assert_eq!(clients.failed_auth.window.0.as_secs(), 60);
    assert!(clients.list.is_empty() && clients.trusted_proxies.is_empty());
}

#[test]
fn unknown_keys_are_refused() {
    one_error(
        &with_clients("  list:\n    - name: a\n      cidrs: [10.0.0.0/8]\n      rutes: [openai]\n"),
        "13:7: clients.list[0].rutes",
        "unknown field `rutes`",
    );
    one_error(
        &with_clients("  mdoe: report\n"),
        "10:3: clients.mdoe",
        "unknown field `mdoe`",
    );
}

#[test]
fn a_short_token_is_refused_without_being_shown() {
    let all = errors(&with_clients(
        "  list:\n    - name: a\n      tokens: [\"short-secret\"]\n",
    ));
    assert_eq!(all.len(), 1, "{all:#?}");
    assert!(
        all[0].starts_with("12:16: clients.list[0].tokens[0]: ")
            && all[0].contains("at least 16 bytes"),
        "{all:#?}"
    );
    assert!(!all[0].contains("short-secret"), "{all:#?}");
}

#[test]
fn a_token_that_is_not_a_string_is_refused_without_being_shown() {
    for token in ["12345678901234567890", "true", "1234567890123456.5"] {
        let all = errors(&with_clients(&format!(
            "  list:\n    - name: a\n      tokens: [{token}]\n"
        )));
        // A long number read as text is a fine token; anything else is refused, unquoted.
        for line in &all {
            assert!(!line.contains(token), "{all:#?}");
        }
    }
}

#[test]
fn two_clients_sharing_a_token_are_refused_without_showing_it() {
    let all = errors(&with_clients(
        "  list:
    - name: a
      tokens: [\"shared-token-0123456789\"]
    - name: b
      tokens: [\"other-token-0123456789\", \"shared-token-0123456789\"]
",
    ));
    assert_eq!(all.len(), 1, "{all:#?}");
    assert!(
        all[0].starts_with("14:42: clients.list[1].tokens[1]: ") && all[0].contains("list[0] (a)"),
        "{all:#?}"
    );
    assert!(!all[0].contains("shared-token"), "{all:#?}");
}

#[test]
fn tokens_from_the_environment_never_reach_an_error() {
    // Two clients given the same secret through two variables: the clash is reported, the
    // secret is not, wherever it would have been echoed.
    let yaml = with_clients(
        "  list:
    - name: a
      tokens: [\"${TOKEN_A}\"]
    - name: b
      tokens: [\"${TOKEN_B}\"]
    - name: c
      tokens: [\"${TOKEN_C}\"]
",
    );
    let secret = "env-secret-0123456789abcdef";
    let all = parse_env(
        &yaml,
        &[
            ("TOKEN_A", secret),
            ("TOKEN_B", secret),
            ("TOKEN_C", "tiny"),
        ],
    )
    .unwrap_err();
    assert_eq!(all.len(), 1, "the short token is caught first: {all:#?}");
    assert!(all[0].contains("clients.list[2].tokens[0]"), "{all:#?}");
    assert!(!all[0].contains("tiny"), "{all:#?}");
    let all = parse_env(
        &yaml,
        &[
            ("TOKEN_A", secret),
            ("TOKEN_B", secret),
            ("TOKEN_C", "another-secret-0123456789"),
        ],
    )
    .unwrap_err();
    assert_eq!(all.len(), 1, "{all:#?}");
    assert!(all[0].contains("clients.list[1].tokens[0]"), "{all:#?}");
    assert!(!all.join("\n").contains(secret), "{all:#?}");
    // And a good config holds the value read.
    let config = parse_env(
        &yaml,
        &[
            ("TOKEN_A", secret),
            ("TOKEN_B", "token-of-b-0123456789"),
            ("TOKEN_C", "another-secret-0123456789"),
        ],
    )
    .unwrap();
    assert_eq!(config.clients.unwrap().list[0].tokens[0].0, secret);
}

#[test]
fn address_only_clients_whose_cidrs_overlap_are_refused() {
    one_error(
        &with_clients(
            "  list:
    - name: a
      cidrs: [\"10.1.0.0/16\"]
    - name: b
      cidrs: [\"192.168.0.0/24\", \"10.1.2.0/24\"]
",
        ),
        "14:33: clients.list[1].cidrs[1]",
        "overlaps 10.1.0.0/16 of list[0] (a)",
    );
    // With a token, a client's cidrs are a further condition, not its identity: no clash.
    assert_eq!(
        errors(&with_clients(
            "  list:
    - name: a
      cidrs: [\"10.1.0.0/16\"]
    - name: b
      tokens: [\"b-token-0123456789abc\"]
      cidrs: [\"10.1.2.0/24\"]
",
        )),
        Vec::<String>::new()
    );
}

#[test]
fn a_route_a_client_names_must_exist() {
    one_error(
        &with_clients("  list:\n    - name: a\n      cidrs: [10.0.0.0/8]\n      routes: [openai, opneai, \"*\"]\n"),
        "13:24: clients.list[0].routes[1]",
        "there is no route named \"opneai\"",
    );
}

#[test]
fn duplicate_client_names_are_refused() {
    one_error(
        &with_clients(
            "  list:\n    - name: a\n      cidrs: [10.0.0.0/8]\n    - name: a\n      cidrs: [10.1.0.0/16]\n      tokens: [\"a-token-0123456789abc\"]\n",
        ),
        "13:13: clients.list[1].name",
        "duplicate client name \"a\": list[0] already has it",
    );
}

#[test]
fn unknown_anonymous_needs_a_client_named_anonymous() {
    one_error(
        &with_clients("  unknown: anonymous\n"),
        "10:12: clients.unknown",
        "the list has none",
    );
}

#[test]
fn no_client_may_be_named_unknown() {
    one_error(
        &with_clients("  list:\n    - name: unknown\n      cidrs: [10.0.0.0/8]\n"),
        "11:13: clients.list[0].name",
        "choose another name",
    );
}

#[test]
fn a_client_nothing_identifies_is_refused() {
    one_error(
        &with_clients("  list:\n    - name: a\n      routes: [openai]\n"),
        "11:7: clients.list[0]",
        "nothing identifies this client",
    );
}

#[test]
fn client_settings_on_routes_need_a_clients_section() {
    one_error(
        "routes:\n  - name: a\n    upstream: {}\n    quota: { key: client, windows: [{ name: s, limit: 1, window: 1s }] }\n",
        "4:19: routes[0].quota.key",
        "there is no clients section",
    );
    one_error(
        "routes:\n  - name: a\n    upstream: {}\n    client_token: x-sluice-token\n",
        "4:19: routes[0].client_token",
        "there is no clients section",
    );
    let config = Config::parse(
        "t.yaml",
        "clients: {}\nroutes:\n  - name: a\n    upstream: {}\n    quota: { key: client, windows: [{ name: s, limit: 1, window: 1s }] }\n",
    )
    .unwrap();
    assert_eq!(
        config.routes[0].quota.as_ref().unwrap().key,
        QuotaKey::Client
    );
}

#[test]
fn a_client_token_header_must_be_one_a_client_may_send() {
    one_error(
        "clients: {}\nroutes:\n  - name: a\n    upstream: {}\n    client_token: Host\n",
        "5:19: routes[0].client_token",
        "cannot carry a client token",
    );
    one_error(
        "clients: {}\nroutes:\n  - name: a\n    upstream: {}\n    client_token: \"bad header\"\n",
        "5:19: routes[0].client_token",
        "invalid header name",
    );
}

#[test]
fn client_fields_check_themselves() {
    one_error(
        &with_clients("  list:\n    - name: \"a b\"\n      cidrs: [10.0.0.0/8]\n"),
        "11:13: clients.list[0].name",
        "invalid client name",
    );
    one_error(
        &with_clients("  list:\n    - name: a\n      cidrs: [10.0.0.0/8]\n      destinations: [\"api.github.com:0\"]\n"),
        "13:22: clients.list[0].destinations[0]",
        "the port must be 1 to 65535",
    );
    one_error(
        &with_clients(
            "  list:\n    - name: a\n      cidrs: [10.0.0.0/8]\n      routes: [\"a.b\"]\n",
        ),
        "13:16: clients.list[0].routes[0]",
        "invalid route",
    );
    one_error(
        &with_clients(
            "  list:\n    - name: a\n      cidrs: [10.0.0.0/8]\n      quota: { windows: [] }\n",
        ),
        "13:25: clients.list[0].quota.windows",
        "at least one window",
    );
    one_error(
        &with_clients("  failed_auth: { cooldown: 2d }\n"),
        "10:28: clients.failed_auth.cooldown",
        "too long",
    );
}

#[test]
fn a_tls_listener_takes_client_certificate_settings() {
    one_error(
        "listen:\n  - addr: 127.0.0.1:8443\n    tls: { cert: c.pem, key: k.pem, client_cert: optional }\nroutes: []\n",
        "3:10: listen[0].tls",
        "client_cert needs client_ca",
    );
}

#[test]
fn two_certificate_names_that_compare_equal_are_refused() {
    // A presented name is compared in lower case, but for a URI's path: these two are one name
    // to the gateway, and the second client could never be reached.
    let all = errors(&with_clients(
        "  list:
    - { name: a, certs: [\"spiffe://Corp.Example/ns/x\"], routes: [\"*\"] }
    - { name: b, certs: [\"spiffe://corp.example/ns/x\"], routes: [\"*\"] }
",
    ));
    assert_eq!(all.len(), 1, "{all:?}");
    assert!(
        all[0].contains("clients.list[1].certs[0]")
            && all[0].contains("is also a certificate name of list[0] (a)"),
        "{all:?}"
    );
    // A path differs by case: two workloads.
    let all = errors(&with_clients(
        "  list:
    - { name: a, certs: [\"spiffe://corp.example/ns/X\"], routes: [\"*\"] }
    - { name: b, certs: [\"spiffe://corp.example/ns/x\"], routes: [\"*\"] }
",
    ));
    assert_eq!(all, Vec::<String>::new());
}
