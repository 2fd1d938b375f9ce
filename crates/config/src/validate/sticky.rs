//! The rules of `upstream.sticky`: the binding's ttl and the table's bound.

use std::time::Duration;

use super::super::position::YamlPath;
use super::super::Config;

/// The shortest `sticky.ttl`: a binding shorter than a second holds no session together.
pub const MIN_STICKY_TTL: Duration = Duration::from_secs(1);
/// The longest `sticky.ttl`: an abandoned session's binding holds a place in the table this
/// long.
pub const MAX_STICKY_TTL: Duration = Duration::from_secs(7 * 24 * 3600);
/// The largest `sticky.max_bindings`: each binding costs the store about 200 bytes.
pub const MAX_BINDINGS: u64 = 10_000_000;

/// The problems of every route's `sticky`.
pub(super) fn problems(config: &Config) -> Vec<(YamlPath, String)> {
    let mut problems = Vec::new();
    for (i, route) in config.routes.iter().enumerate() {
        let Some(sticky) = &route.upstream.sticky else {
            continue;
        };
        let at = YamlPath::root()
            .key("routes")
            .index(i)
            .key("upstream")
            .key("sticky");
        if !(MIN_STICKY_TTL..=MAX_STICKY_TTL).contains(&sticky.ttl.0) {
            problems.push((
                at.clone().key("ttl"),
                format!(
                    "sticky.ttl must be between {}s and {}h",
                    MIN_STICKY_TTL.as_secs(),
                    MAX_STICKY_TTL.as_secs() / 3600
                ),
            ));
        }
        if sticky.max_bindings.get() > MAX_BINDINGS {
            problems.push((
                at.key("max_bindings"),
                format!("sticky.max_bindings is at most {MAX_BINDINGS}"),
            ));
        }
    }
    problems
}

#[cfg(test)]
mod tests {
    use super::super::super::tests::{errors, one_error};
    use crate::{RebindOn, StickyKey};

    fn route(sticky: &str) -> String {
        format!("routes:\n  - name: a\n    upstream:\n      sticky: {sticky}\n")
    }

    #[test]
    fn sticky_parses_with_its_defaults() {
        let yaml = route("{ key: \"header:X-Session-Id\" }");
        assert!(errors(&yaml).is_empty(), "{:?}", errors(&yaml));
        let config = crate::Config::parse("t.yaml", &yaml).unwrap();
        let s = config.routes[0].upstream.sticky.as_ref().unwrap();
        assert_eq!(s.key, StickyKey::Header("x-session-id".into()));
        assert_eq!(s.ttl.0, std::time::Duration::from_secs(600));
        assert_eq!(s.rebind_on, [RebindOn::Status(429), RebindOn::ConnectError]);
        assert_eq!(s.max_bindings.get(), 100_000);

        let yaml = route(
            "{ key: \"cookie:sid\", ttl: 1h, rebind_on: [403, connect_error], max_bindings: 5 }",
        );
        assert!(errors(&yaml).is_empty(), "{:?}", errors(&yaml));
        let config = crate::Config::parse("t.yaml", &yaml).unwrap();
        let s = config.routes[0].upstream.sticky.as_ref().unwrap();
        assert_eq!(s.key, StickyKey::Cookie("sid".into()));
        assert_eq!(s.rebind_on, [RebindOn::Status(403), RebindOn::ConnectError]);
        assert_eq!(s.max_bindings.get(), 5);
        let yaml = route("{ key: client }");
        assert!(errors(&yaml).is_empty(), "{:?}", errors(&yaml));
    }

    #[test]
    fn check_refuses_a_bad_key_and_bounds() {
        for key in [
            "header:",
            "header",
            "cookie:a b",
            "query:x",
            "Client",
            "header:a:b",
        ] {
            let yaml = route(&format!("{{ key: {key:?} }}"));
            let errs = errors(&yaml);
            assert!(
                errs.iter().any(|e| e.contains("invalid sticky key")),
                "{key}: {errs:?}"
            );
        }
        one_error(
            &route("{ key: client, ttl: 500ms }"),
            "4:35: routes[0].upstream.sticky.ttl",
            "between 1s and 168h",
        );
        one_error(
            &route("{ key: client, ttl: 8d }"),
            "4:35: routes[0].upstream.sticky.ttl",
            "between 1s and 168h",
        );
        one_error(
            &route("{ key: client, max_bindings: 10000001 }"),
            "4:44: routes[0].upstream.sticky.max_bindings",
            "at most 10000000",
        );
        assert!(!errors(&route("{ key: client, max_bindings: 0 }")).is_empty());
        assert!(!errors(&route("{ key: client, rebind_on: [700] }")).is_empty());
        assert!(!errors(&route("{ key: client, rebind_on: [timeout] }")).is_empty());
        assert!(!errors(&route("{ key: client, bind: 1 }")).is_empty());
    }
}
