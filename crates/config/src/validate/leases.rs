//! The rules of leases: `upstream.lease_ttl` and the `max_in_flight` caps.

use std::time::Duration;

use super::super::position::YamlPath;
use super::super::{Config, FallbackOn};

/// The shortest `lease_ttl`: leases are renewed at a third of it, by a task that looks every
/// 250 ms, and a renewal must land before the lease expires.
pub const MIN_LEASE_TTL: Duration = Duration::from_secs(1);
/// The longest `lease_ttl`: what a lease of an instance that died keeps counting for.
pub const MAX_LEASE_TTL: Duration = Duration::from_secs(3600);
/// The largest `max_in_flight`: past it the cap is a typo, and the memory store's table of
/// leases stays bounded by it.
pub const MAX_IN_FLIGHT: u64 = 1_000_000;

/// The problems of every route's leases, and of the clients' caps.
pub(super) fn problems(config: &Config) -> Vec<(YamlPath, String)> {
    let mut problems = Vec::new();
    let clients = config.clients.iter().flat_map(|c| c.list.iter());
    for (i, client) in clients.enumerate() {
        if client
            .max_in_flight
            .is_some_and(|c| c.get() > MAX_IN_FLIGHT)
        {
            problems.push((
                YamlPath::root()
                    .key("clients")
                    .key("list")
                    .index(i)
                    .key("max_in_flight"),
                format!("max_in_flight is at most {MAX_IN_FLIGHT}"),
            ));
        }
    }
    for (i, route) in config.routes.iter().enumerate() {
        let at = YamlPath::root().key("routes").index(i);
        let up = &route.upstream;
        let ttl = up.lease_ttl.0;
        if !(MIN_LEASE_TTL..=MAX_LEASE_TTL).contains(&ttl) {
            problems.push((
                at.clone().key("upstream").key("lease_ttl"),
                format!(
                    "lease_ttl must be between {}s and {}s: leases are renewed at a third of it, and a dead instance's leases count until it passes",
                    MIN_LEASE_TTL.as_secs(),
                    MAX_LEASE_TTL.as_secs()
                ),
            ));
        }
        for (cap, at) in [
            (
                up.max_in_flight,
                at.clone().key("upstream").key("max_in_flight"),
            ),
            (route.max_in_flight, at.clone().key("max_in_flight")),
        ] {
            if cap.is_some_and(|c| c.get() > MAX_IN_FLIGHT) {
                problems.push((at, format!("max_in_flight is at most {MAX_IN_FLIGHT}")));
            }
        }
        // Without a cap the route never answers concurrency_exceeded: the entry would never
        // apply, which is a mistake in the config rather than a choice.
        if up.max_in_flight.is_none() && route.max_in_flight.is_none() {
            for (j, entry) in route.fallback.iter().enumerate() {
                for (k, on) in entry.on.iter().enumerate() {
                    if *on == FallbackOn::ConcurrencyExceeded {
                        problems.push((
                            at.clone().key("fallback").index(j).key("on").index(k),
                            "concurrency_exceeded needs max_in_flight on the route or its upstream"
                                .to_string(),
                        ));
                    }
                }
            }
        }
    }
    problems
}

#[cfg(test)]
mod tests {
    use super::super::super::tests::{errors, one_error};

    fn route(lines: &str) -> String {
        format!("routes:\n  - name: a\n{lines}")
    }

    #[test]
    fn leases_parse_with_their_defaults() {
        let yaml = route(
            "    max_in_flight: 200\n    upstream:\n      selection: least_in_flight\n      max_in_flight: 50\n",
        );
        assert!(errors(&yaml).is_empty(), "{:?}", errors(&yaml));
        let config = crate::Config::parse("t.yaml", &yaml).unwrap();
        let r = &config.routes[0];
        assert_eq!(r.max_in_flight.map(|n| n.get()), Some(200));
        assert_eq!(r.upstream.max_in_flight.map(|n| n.get()), Some(50));
        assert_eq!(r.upstream.lease_ttl.0, std::time::Duration::from_secs(30));
    }

    #[test]
    fn a_capped_route_may_fall_back_on_concurrency_exceeded() {
        let yaml = "routes:\n  - name: a\n    max_in_flight: 2\n    upstream: {}\n    fallback: [{ route: b, on: [concurrency_exceeded] }]\n  - name: b\n    match: { hosts: [b.test] }\n    upstream: {}\n";
        assert!(errors(yaml).is_empty(), "{:?}", errors(yaml));
        let config = crate::Config::parse("t.yaml", yaml).unwrap();
        assert_eq!(
            config.routes[0].fallback[0].on,
            [crate::FallbackOn::ConcurrencyExceeded]
        );
    }

    #[test]
    fn check_refuses_leases_out_of_bounds() {
        one_error(
            &route("    upstream: { lease_ttl: 500ms }\n"),
            "3:28: routes[0].upstream.lease_ttl",
            "between 1s and 3600s",
        );
        one_error(
            &route("    upstream: { lease_ttl: 2h }\n"),
            "3:28: routes[0].upstream.lease_ttl",
            "between 1s and 3600s",
        );
        one_error(
            &route("    max_in_flight: 1000001\n    upstream: {}\n"),
            "3:20: routes[0].max_in_flight",
            "at most 1000000",
        );
        assert!(!errors(&route("    max_in_flight: 0\n    upstream: {}\n")).is_empty());
        let client = |cap: &str| {
            format!("clients:\n  list:\n    - name: c\n      tokens: [\"0123456789abcdef\"]\n      max_in_flight: {cap}\nroutes:\n  - name: a\n    upstream: {{}}\n")
        };
        assert!(
            errors(&client("2")).is_empty(),
            "{:?}",
            errors(&client("2"))
        );
        one_error(
            &client("1000001"),
            "5:22: clients.list[0].max_in_flight",
            "at most 1000000",
        );
        assert!(!errors(&client("0")).is_empty());
        // A client's cap, like a route's, is something a windowless quota's max_wait waits at.
        let waits =
            client("1").replace("upstream: {}", "quota: { max_wait: 5s }\n    upstream: {}");
        assert!(errors(&waits).is_empty(), "{:?}", errors(&waits));
        // A quota with no windows may only set max_wait for a cap to wait at.
        assert!(errors(&route(
            "    quota: { max_wait: 5s }\n    upstream: { max_in_flight: 2 }\n"
        ))
        .is_empty());
    }
}
