//! The key-pool settings of SPEC §8: member names, headers, member quotas, cooldowns and
//! waiting. Errors come out as `LINE:COL: PATH: message`, at the node to blame, and never show
//! a header value.

use super::tests::{errors, one_error};
use super::*;

fn pool(members: &str, extra: &str) -> String {
    format!(
        "routes:\n  - name: r\n    upstream:\n      selection: least_used\n      members:\n{members}{extra}"
    )
}

const KEY_POOL: &str = r#"        - url: "https://api.test"
          name: key-a
          headers: { Authorization: "Bearer sk-aaaa", X-Org: 7 }
          quota: { windows: [{ name: rpm, limit: 60, window: 1m }] }
        - url: "https://api.test"
          name: key-b
          headers: { Authorization: "Bearer sk-bbbb" }
"#;

#[test]
fn a_pool_of_keys_on_one_url() {
    let yaml = pool(
        KEY_POOL,
        "      cooldown: { default: 10s, max: 1m, retry: true }\n    quota: { max_wait: 2s, windows: [{ name: s, limit: 5, window: 1s }] }\n",
    );
    let config = Config::parse("t.yaml", &yaml).unwrap_or_else(|e| panic!("{e}"));
    let up = &config.routes[0].upstream;
    assert_eq!(&*up.members[0].name, "key-a");
    assert_eq!(&*up.members[1].name, "key-b");
    let (name, value) = &up.members[0].headers.0[1];
    assert_eq!((name.as_str(), value.to_str().unwrap()), ("x-org", "7"));
    assert!(up.members[0].headers.0[0].1.is_sensitive());
    assert_eq!(
        up.members[0].quota.as_ref().unwrap().windows[0].limit.get(),
        60
    );
    let cooldown = up.cooldown.as_ref().unwrap();
    assert_eq!(cooldown.on_status, [429], "the default");
    assert!(cooldown.retry);
    let quota = config.routes[0].quota.as_ref().unwrap();
    assert_eq!(quota.max_wait.0, std::time::Duration::from_secs(2));
    assert_eq!(quota.max_waiting.get(), 1000, "the default");
    // Debug (which any log of the config would use) names the headers, never their values.
    let shown = format!("{config:?}");
    assert!(shown.contains("authorization"), "{shown}");
    assert!(
        !shown.contains("sk-aaaa") && !shown.contains("sk-bbbb"),
        "{shown}"
    );
}

#[test]
fn unnamed_members_are_named_by_their_url() {
    let yaml = pool(
        "        - url: \"HTTP://A.test:8080\"\n        - proxy: \"http://user:pw@p.test:3128\"\n",
        "",
    );
    assert_eq!(
        errors(&yaml),
        [
            "7:11: routes[0].upstream.members[1]: a pool holds origins (url) only, or proxy and direct members only: members[0] is an origin (url)"
        ]
    );
    let config = Config::parse(
        "t.yaml",
        &pool("        - url: \"HTTP://A.test:8080\"\n", ""),
    )
    .unwrap();
    assert_eq!(
        &*config.routes[0].upstream.members[0].name,
        "http://a.test:8080"
    );
    let config = Config::parse(
        "t.yaml",
        &pool(
            "        - proxy: \"http://user:pw@p.test:3128\"\n        - direct: true\n",
            "",
        ),
    )
    .unwrap();
    let names: Vec<&str> = config.routes[0]
        .upstream
        .members
        .iter()
        .map(|m| &*m.name)
        .collect();
    assert_eq!(
        names,
        ["http://p.test:3128", "direct"],
        "credentials are not part of a name"
    );
}

#[test]
fn names_must_be_unique_and_shared_urls_need_names() {
    one_error(
        &pool(
            "        - { url: \"http://a.test\", name: k }\n        - { url: \"http://b.test\", name: k }\n",
            "",
        ),
        "7:41: routes[0].upstream.members[1].name",
        "duplicate member name \"k\": members[0] has it",
    );
    one_error(
        &pool(
            "        - { url: \"http://a.test\", name: k }\n        - { url: \"http://a.test\" }\n",
            "",
        ),
        "7:18: routes[0].upstream.members[1].url",
        "two members on one address need a name each",
    );
    one_error(
        &pool("        - { url: \"http://a.test\", name: \"a b\" }\n", ""),
        "6:41: routes[0].upstream.members[0].name",
        "invalid member name \"a b\"",
    );
    // An unnamed member whose URL is another's explicit name.
    one_error(
        &pool(
            "        - { url: \"http://b.test\", name: \"http:a\" }\n        - { url: \"http://c.test\", name: \"http:a\" }\n",
            "",
        ),
        "7:41: routes[0].upstream.members[1].name",
        "duplicate member name",
    );
}

#[test]
fn header_mistakes_never_show_the_value() {
    one_error(
        &pool(
            "        - { url: \"http://a.test\", headers: { Host: x } }\n",
            "",
        ),
        "6:44: routes[0].upstream.members[0].headers",
        "cannot be set per member",
    );
    one_error(
        &pool(
            "        - { url: \"http://a.test\", headers: { X-Key: a, x-key: b } }\n",
            "",
        ),
        "6:44: routes[0].upstream.members[0].headers",
        "is given twice",
    );
    let yaml = pool(
        "        - { url: \"http://a.test\", headers: { Authorization: \"Bearer sk-SECRET\\n\" } }\n",
        "",
    );
    let all = errors(&yaml);
    assert_eq!(all.len(), 1, "{all:?}");
    assert!(all[0].contains("not a valid header value"), "{all:?}");
    assert!(!all[0].contains("sk-SECRET"), "{all:?}");
}

#[test]
fn origin_credentials_point_to_headers() {
    let yaml = pool("        - url: \"https://user:sk-SECRET@api.test\"\n", "");
    let all = errors(&yaml);
    assert_eq!(all.len(), 1, "{all:?}");
    assert!(
        all[0].contains("set them in the member's headers"),
        "{all:?}"
    );
    assert!(!all[0].contains("sk-SECRET"), "{all:?}");
}

#[test]
fn member_quota_and_cooldown_mistakes() {
    one_error(
        &pool(
            "        - { url: \"http://a.test\", quota: { windows: [{ name: m, limit: 1, window: 500us }] } }\n",
            "",
        ),
        "6:83: routes[0].upstream.members[0].quota.windows[0].window",
        "shorter than 1ms",
    );
    one_error(
        &pool(
            "        - { url: \"http://a.test\", quota: { windows: [] } }\n",
            "",
        ),
        "6:53: routes[0].upstream.members[0].quota.windows",
        "a member quota needs at least one window",
    );
    let member = "        - url: \"http://a.test\"\n";
    one_error(
        &pool(member, "      cooldown: { on_status: [200] }\n"),
        "7:31: routes[0].upstream.cooldown.on_status[0]",
        "200 is not an error status",
    );
    one_error(
        &pool(member, "      cooldown: { default: 2m, max: 1m }\n"),
        "7:28: routes[0].upstream.cooldown.default",
        "default 2m is longer than max 1m",
    );
    one_error(
        &pool(member, "      cooldown: { max: 2d }\n"),
        "7:24: routes[0].upstream.cooldown.max",
        "can be at most 1d",
    );
}

#[test]
fn waiting_needs_something_to_wait_for() {
    let member = "        - url: \"http://a.test\"\n";
    one_error(
        &pool(member, "    quota: { max_wait: 1s }\n"),
        "7:12: routes[0].quota.windows",
        "a quota needs at least one window",
    );
    let ok = pool(
        "        - { url: \"http://a.test\", quota: { windows: [{ name: m, limit: 1, window: 1s }] } }\n",
        "    quota: { max_wait: 1s, max_waiting: 3 }\n",
    );
    assert_eq!(errors(&ok), Vec::<String>::new());
    one_error(
        &pool(
            member,
            "    quota: { max_wait: 10m, windows: [{ name: s, limit: 1, window: 1s }] }\n",
        ),
        "7:24: routes[0].quota.max_wait",
        "can be at most 5m",
    );
    one_error(
        &pool(
            member,
            "    quota: { max_waiting: 0, windows: [{ name: s, limit: 1, window: 1s }] }\n",
        ),
        "7:27: routes[0].quota.max_waiting",
        "",
    );
}

#[test]
fn headers_on_members_that_reach_the_clients_target_are_refused() {
    // A direct or proxy member goes where the client points: its headers would follow.
    for member in [
        "        - { direct: true, headers: { Authorization: \"Bearer sk-SECRET\" } }\n",
        "        - { proxy: \"http://10.0.0.5:3128\", headers: { Authorization: \"Bearer sk-SECRET\" } }\n",
    ] {
        let all = errors(&pool(member, ""));
        assert_eq!(all.len(), 1, "{all:?}");
        assert!(
            all[0].contains("routes[0].upstream.members[0].headers")
                && all[0].contains("sent only to an origin member's own url"),
            "{all:?}"
        );
        assert!(!all[0].contains("sk-SECRET"), "{all:?}");
    }
    // On an origin member they are what a key pool is made of.
    assert_eq!(errors(&pool(KEY_POOL, "")), Vec::<String>::new());
}

#[test]
fn a_cooldown_on_a_direct_member_is_refused() {
    // A `direct` member stands for every destination: one server's 429 would cool it for all.
    let direct = "        - direct: true\n      cooldown: { on_status: [429] }\n";
    let all = errors(&pool(direct, ""));
    assert_eq!(all.len(), 1, "{all:?}");
    assert!(
        all[0].starts_with("7:17: routes[0].upstream.cooldown: ")
            && all[0].contains("members[0] is `direct`"),
        "{all:?}"
    );
    // Proxies keep it: a provider that limits by address limits each egress proxy on its own.
    let proxies = "        - proxy: \"http://10.0.0.5:3128\"\n        - proxy: \"http://10.0.0.6:3128\"\n      cooldown: { on_status: [429] }\n";
    assert_eq!(errors(&pool(proxies, "")), Vec::<String>::new());
}
