//! The rules of a route's `state_shards`: how many sub-logs its state is split into on Redis.
//!
//! Each sub-log admits its share of every limit (the limit divided by the sub-logs, the
//! remainder on the first ones), so a request must fit in one share, and so must one lease or
//! one binding in a cap's share. Reservations (settled later, in the sub-log they were taken
//! from, which is not kept yet) are refused with more than one, and so is `priority` over
//! members with windows of their own (below). `state_shards_start: home` needs sub-logs to
//! start at, on Redis an instance index to pick its own by, and requests that share store calls:
//! it is refused where every request takes a lease or has a sticky session.

use super::super::position::YamlPath;
use super::super::schema::{RouteGrant, ShardsStart, StateBackend, WindowConfig, WindowUnit};
use super::super::Config;

/// The most sub-logs a route may have: a Redis Cluster seldom has more masters for one route
/// to use, and a request that finds every other sub-log full may try each one.
pub const MAX_STATE_SHARDS: u32 = 16;

/// The problems of every route's `state_shards`.
pub(super) fn problems(config: &Config) -> Vec<(YamlPath, String)> {
    let mut problems = Vec::new();
    let clients: Vec<_> = config.clients.iter().flat_map(|c| c.list.iter()).collect();
    // Without an index of its own, every instance would take one sub-log for its own.
    let unindexed = config.state.backend == StateBackend::Redis
        && config
            .state
            .redis
            .as_ref()
            .is_none_or(|r| r.instance_index.is_none());
    // Said once, at the first route that needs it: the one setting serves them all.
    let mut index_told = false;
    // A client's cap counts the leases of its requests on every route, so with one, every
    // request of every route takes a lease.
    let capped = clients.iter().find(|c| c.max_in_flight.is_some());
    for (i, route) in config.routes.iter().enumerate() {
        let shards = route.state_shards.get();
        let route_at = YamlPath::root().key("routes").index(i);
        if route.state_shards_start == ShardsStart::Home {
            let start_at = route_at.clone().key("state_shards_start");
            if shards == 1 {
                problems.push((
                    start_at.clone(),
                    "state_shards_start: home needs state_shards above 1: a route in one log has no sub-log to start at".to_string(),
                ));
            } else if unindexed && !index_told {
                index_told = true;
                problems.push((
                    start_at.clone(),
                    "state_shards_start: home starts an instance's requests at sub-log state.redis.instance_index mod state_shards: set state.redis.instance_index, 0, 1, 2, … one of its own on each instance (`${NAME}` reads it from the environment)".to_string(),
                ));
            }
            // A request with a lease or a sticky session keeps a store call of its own (the
            // store's batch.rs), so starting every one at the instance's own sub-log fills no
            // call; and a sub-log at its share of leases is not remembered as a full quota is,
            // so each request would pay a refused call there before the next.
            let own_calls = if route.max_in_flight.is_some() {
                Some("max_in_flight".to_string())
            } else if route.upstream.max_in_flight.is_some() {
                Some("upstream.max_in_flight".to_string())
            } else if route.upstream.selection.as_str() == "least_in_flight" {
                Some("selection: least_in_flight".to_string())
            } else if let Some(c) = capped {
                Some(format!(
                    "a client's max_in_flight (client {:?}), which makes every route's requests take leases",
                    c.name.0
                ))
            } else if route.upstream.sticky.is_some() {
                Some("upstream.sticky".to_string())
            } else {
                None
            };
            if let Some(why) = own_calls {
                problems.push((
                    start_at,
                    format!("state_shards_start: home cannot be used with {why}: each such request (a lease, a sticky session) has a store call of its own, so home fills no call, and an instance's own sub-log at its share of leases costs a refused call before the next; leave the default, round_robin"),
                ));
            }
        }
        if shards == 1 {
            continue;
        }
        let at = route_at.clone().key("state_shards");
        if shards > MAX_STATE_SHARDS {
            problems.push((
                at.clone(),
                format!("state_shards is at most {MAX_STATE_SHARDS}"),
            ));
            continue;
        }
        // Each sub-log keeps its share of a cap on leases or bindings: at least one.
        for (cap, cap_at) in [
            (
                route.max_in_flight.map(|c| c.get()),
                route_at.clone().key("max_in_flight"),
            ),
            (
                route.upstream.max_in_flight.map(|c| c.get()),
                route_at.clone().key("upstream").key("max_in_flight"),
            ),
            (
                route.upstream.sticky.as_ref().map(|s| s.max_bindings.get()),
                route_at
                    .clone()
                    .key("upstream")
                    .key("sticky")
                    .key("max_bindings"),
            ),
        ] {
            if cap.is_some_and(|c| c < u64::from(shards)) {
                problems.push((
                    cap_at,
                    format!("state_shards: {shards} splits this cap into {shards} shares: it must be at least {shards}"),
                ));
            }
        }
        let mut refuse = |why: &str| {
            problems.push((
                at.clone(),
                format!("state_shards above 1 cannot be used with {why}"),
            ));
        };
        // Priority sends every request to the first member with room; each sub-log holds its
        // share of a member's windows, so one whose share of the first member is spent would
        // send requests to a backup while that member has room in the other sub-logs. The
        // policy is the gateway's to name, but this rule is the sub-logs'.
        if route.upstream.selection.as_str() == "priority"
            && route.upstream.members.iter().any(|m| m.quota.is_some())
        {
            refuse("selection: priority over members with quota windows of their own: each sub-log holds its share of a member's windows, so one whose share of the first member is spent would send requests to a backup while that member has room in the other sub-logs");
        }
        let quota = route.quota.as_ref();
        if quota.is_some_and(|q| q.usage.is_some()) {
            refuse("quota.usage: a reservation is settled in the sub-log it was taken from, which is not kept yet");
        }
        let granted = clients.iter().find(|c| {
            c.routes.iter().any(|g| {
                matches!(g, RouteGrant::All)
                    || matches!(g, RouteGrant::Route(r) if r.0 == route.name.0)
            }) && c
                .quota
                .as_ref()
                .is_some_and(|q| q.windows.iter().any(reserves))
        });
        if let Some(c) = granted {
            refuse(&format!(
                "client {:?}, granted this route, whose windows count usage units or calendar periods: a reservation is settled in the sub-log it was taken from, which is not kept yet",
                c.name.0
            ));
        }
        // The largest cost a request of the route may have: it is charged to the route's
        // windows and to its member's.
        let cost = quota.map_or(1, |q| {
            q.cost
                .rules
                .iter()
                .map(|r| r.cost.get())
                .fold(q.cost.default.get(), u64::max)
        });
        let route_windows = quota.map_or(&[][..], |q| &q.windows[..]);
        let mut check = |windows: &[WindowConfig], windows_at: YamlPath| {
            for (j, w) in windows.iter().enumerate() {
                let window_at = windows_at.clone().index(j);
                if reserves(w) {
                    problems.push((
                        window_at.clone(),
                        "state_shards above 1 cannot be used with a window in usage units or calendar periods: a reservation is settled in the sub-log it was taken from, which is not kept yet".to_string(),
                    ));
                } else if w.limit.get() / cost < u64::from(shards) {
                    problems.push((
                        window_at.key("limit"),
                        format!(
                            "state_shards: {shards} splits this limit into {shards} shares of about {} each, which cannot hold a request of the route's largest cost ({cost}): the limit must be at least state_shards × that cost ({})",
                            w.limit.get() / u64::from(shards),
                            u64::from(shards).saturating_mul(cost)
                        ),
                    ));
                }
            }
        };
        check(route_windows, route_at.clone().key("quota").key("windows"));
        for (m, member) in route.upstream.members.iter().enumerate() {
            if let Some(q) = &member.quota {
                check(
                    &q.windows,
                    route_at
                        .clone()
                        .key("upstream")
                        .key("members")
                        .index(m)
                        .key("quota")
                        .key("windows"),
                );
            }
        }
    }
    problems
}

/// Whether a window is reserved rather than only counted.
fn reserves(w: &WindowConfig) -> bool {
    w.calendar().is_some() || !matches!(w.unit, WindowUnit::Requests)
}

#[cfg(test)]
mod tests {
    use super::super::super::tests::{errors, one_error};

    fn route(lines: &str) -> String {
        format!("routes:\n  - name: a\n    upstream: {{}}\n{lines}")
    }

    #[test]
    fn state_shards_default_to_one_and_parse() {
        let config = crate::Config::parse("t.yaml", &route("")).unwrap();
        assert_eq!(config.routes[0].state_shards.get(), 1);
        let yaml = route(
            "    state_shards: 3\n    quota:\n      windows: [{name: m, limit: 300, window: 1m}]\n      cost: {default: 1, rules: [{path_prefix: /big, cost: 100}]}\n",
        );
        assert!(errors(&yaml).is_empty(), "{:?}", errors(&yaml));
        let config = crate::Config::parse("t.yaml", &yaml).unwrap();
        assert_eq!(config.routes[0].state_shards.get(), 3);
    }

    #[test]
    fn check_refuses_more_shares_than_a_limit_holds_requests() {
        one_error(
            &route("    state_shards: 4\n    quota:\n      windows: [{name: m, limit: 300, window: 1m}]\n      cost: {default: 1, rules: [{path_prefix: /big, cost: 100}]}\n"),
            "6:34: routes[0].quota.windows[0].limit",
            "the limit must be at least state_shards × that cost (400)",
        );
        let member = "routes:\n  - name: a\n    state_shards: 3\n    upstream:\n      selection: least_used\n      members:\n        - url: http://k.test\n          quota: {windows: [{name: rpm, limit: 2, window: 1m}]}\n";
        one_error(
            member,
            "8:48: routes[0].upstream.members[0].quota.windows[0].limit",
            "the limit must be at least state_shards × that cost (3)",
        );
        one_error(
            &route("    state_shards: 17\n"),
            "4:19: routes[0].state_shards",
            "at most 16",
        );
        assert!(!errors(&route("    state_shards: 0\n")).is_empty());
    }

    #[test]
    fn check_refuses_what_sub_logs_do_not_keep() {
        let all = errors(&route(
            "    state_shards: 2
    quota:
      windows: [{name: d, limit: 300, window: calendar_day}]
",
        ));
        assert!(
            all.len() == 1
                && all[0].contains("state_shards above 1")
                && all[0].contains("calendar"),
            "{all:#?}"
        );
        let usage = "clients:\n  list:\n    - name: c\n      tokens: [\"0123456789abcdef\"]\n      routes: [a]\n      quota: {windows: [{name: d, limit: 5, window: calendar_day}]}\nroutes:\n  - name: a\n    state_shards: 2\n    upstream: {}\n";
        one_error(usage, "9:19: routes[0].state_shards", "client \"c\"");
    }

    #[test]
    fn check_refuses_priority_over_members_with_windows() {
        let pool = |selection: &str, quota: &str| {
            format!("routes:\n  - name: a\n    state_shards: 3\n    upstream:\n      selection: {selection}\n      members:\n        - url: http://k.test\n{quota}        - url: http://b.test\n")
        };
        let windows = "          quota: {windows: [{name: rpm, limit: 30, window: 1m}]}\n";
        one_error(
            &pool("priority", windows),
            "3:19: routes[0].state_shards",
            "selection: priority over members with quota windows",
        );
        // Without member windows, or with another policy, each sub-log's choice is the same.
        for ok in [pool("priority", ""), pool("least_used", windows)] {
            assert!(errors(&ok).is_empty(), "{ok}: {:?}", errors(&ok));
        }
    }

    #[test]
    fn home_needs_sub_logs_and_on_redis_an_instance_index() {
        let redis = |index: &str| {
            format!(
                "state:\n  backend: redis\n  redis:\n    url: \"redis://127.0.0.1:6379\"\n{index}"
            )
        };
        let home = |shards: u32| {
            route(&format!(
                "    state_shards: {shards}\n    state_shards_start: home\n"
            ))
        };
        let indexed = redis("    instance_index: 2\n");
        let ok = format!("{indexed}{}", home(3));
        assert!(errors(&ok).is_empty(), "{:?}", errors(&ok));
        let config = crate::Config::parse("t.yaml", &ok).unwrap();
        assert_eq!(
            config.routes[0].state_shards_start,
            crate::ShardsStart::Home
        );
        assert_eq!(config.state.redis.unwrap().instance_index, Some(2));
        // The default takes them in turn, and needs no index.
        let rr = format!("{}{}", redis(""), route("    state_shards: 3\n"));
        assert!(errors(&rr).is_empty(), "{:?}", errors(&rr));
        let config = crate::Config::parse("t.yaml", &rr).unwrap();
        assert_eq!(
            config.routes[0].state_shards_start,
            crate::ShardsStart::RoundRobin
        );
        one_error(
            &format!("{indexed}{}", home(1)),
            "10:25: routes[0].state_shards_start",
            "needs state_shards above 1",
        );
        one_error(
            &format!("{}{}", redis(""), home(3)),
            "9:25: routes[0].state_shards_start",
            "set state.redis.instance_index",
        );
        // Said once, at the first route, however many routes want it.
        let second =
            "  - name: b\n    match: {path_prefix: /b}\n    upstream: {}\n    state_shards: 2\n    state_shards_start: home\n";
        one_error(
            &format!("{}{}{second}", redis(""), home(3)),
            "9:25: routes[0].state_shards_start",
            "set state.redis.instance_index",
        );
        // The memory store keeps one log whatever the route says: no index to pick by.
        assert!(errors(&home(3)).is_empty(), "{:?}", errors(&home(3)));
        one_error(&home(1), "5:25: routes[0].state_shards_start", "above 1");
        assert!(!errors(&route("    state_shards: 3\n    state_shards_start: own\n")).is_empty());
    }

    #[test]
    fn home_is_refused_where_requests_keep_a_call_of_their_own() {
        let home = |upstream: &str, more: &str| {
            format!("routes:\n  - name: a\n    state_shards: 3\n    state_shards_start: home\n    upstream:\n      members: [{{url: http://k.test}}]\n{upstream}{more}")
        };
        let at = "4:25: routes[0].state_shards_start";
        one_error(
            &home("", "    max_in_flight: 3\n"),
            at,
            "with max_in_flight:",
        );
        one_error(
            &home("      max_in_flight: 3\n", ""),
            at,
            "with upstream.max_in_flight:",
        );
        one_error(
            &home("      selection: least_in_flight\n", ""),
            at,
            "with selection: least_in_flight:",
        );
        one_error(
            &home(
                "      sticky: { key: \"header:x-session\", max_bindings: 3 }\n",
                "",
            ),
            at,
            "with upstream.sticky:",
        );
        let capped = format!("clients:\n  list:\n    - name: c\n      tokens: [\"0123456789abcdef\"]\n      max_in_flight: 2\n{}", home("", ""));
        one_error(
            &capped,
            "9:25: routes[0].state_shards_start",
            "a client's max_in_flight (client \"c\")",
        );
        // Requests that share calls, and round_robin with leases, are fine.
        for ok in [
            home("", ""),
            home("", "    max_in_flight: 3\n").replace("home", "round_robin"),
        ] {
            assert!(errors(&ok).is_empty(), "{ok}: {:?}", errors(&ok));
        }
    }

    #[test]
    fn leases_and_bindings_split_when_each_share_holds_one() {
        let ok = "clients:\n  list:\n    - name: c\n      tokens: [\"0123456789abcdef\"]\n      max_in_flight: 2\nroutes:\n  - name: a\n    state_shards: 2\n    max_in_flight: 4\n    upstream:\n      max_in_flight: 2\n      sticky: { key: client, max_bindings: 2 }\n";
        assert!(errors(ok).is_empty(), "{:?}", errors(ok));
        one_error(
            &route("    state_shards: 3\n    max_in_flight: 2\n"),
            "5:20: routes[0].max_in_flight",
            "at least 3",
        );
        let sticky = "routes:\n  - name: a\n    state_shards: 3\n    upstream:\n      sticky: { key: client, max_bindings: 2 }\n";
        one_error(
            sticky,
            "5:44: routes[0].upstream.sticky.max_bindings",
            "at least 3",
        );
    }
}
