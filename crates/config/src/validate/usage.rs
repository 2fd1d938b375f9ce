//! The rules of usage-metered quotas that span several fields: every unit a window names is
//! defined, every unit defined is counted by some window, and each amount can be computed where
//! it is used (a reservation before the answer exists, a settlement from the answer).
//!
//! Units are defined on a route's `quota.usage`. The route's windows and its members' windows
//! count in them; a client's windows count in any unit some route defines, and on each route
//! that defines it, by that route's definition.

use std::collections::HashSet;

use super::super::position::YamlPath;
use super::super::schema::*;
use super::super::Config;

/// `problems` gains an entry if `w` counts in a unit and its limit is past what millionths
/// hold exactly.
pub(super) fn check_unit_limit(
    problems: &mut Vec<(YamlPath, String)>,
    window_at: &YamlPath,
    w: &WindowConfig,
) {
    if w.unit != WindowUnit::Requests && w.limit.get() as f64 > MAX_AMOUNT {
        problems.push((
            window_at.clone().key("limit"),
            format!(
                "limit {} is too large for a window in a usage unit: at most {MAX_AMOUNT}, as amounts are kept in millionths and Redis scripts count in doubles",
                w.limit
            ),
        ));
    }
}

/// The problems of every `unit`, `usage` and the amounts in it.
pub(super) fn problems(config: &Config) -> Vec<(YamlPath, String)> {
    let mut problems = Vec::new();
    let client_units: HashSet<&UnitName> = config
        .clients
        .iter()
        .flat_map(|c| &c.list)
        .flat_map(|c| &c.quota)
        .flat_map(|q| &q.windows)
        .filter_map(|w| named(&w.unit))
        .collect();
    let mut route_units: HashSet<&UnitName> = HashSet::new();
    for (i, route) in config.routes.iter().enumerate() {
        let at = YamlPath::root().key("routes").index(i);
        let usage = route.quota.as_ref().and_then(|q| q.usage.as_ref());
        let mut used: HashSet<&UnitName> = HashSet::new();
        let mut windows: Vec<(YamlPath, &WindowConfig)> = Vec::new();
        if let Some(quota) = &route.quota {
            for (j, w) in quota.windows.iter().enumerate() {
                windows.push((at.clone().key("quota").key("windows").index(j), w));
            }
        }
        for (m, member) in route.upstream.members.iter().enumerate() {
            for (j, w) in member.quota.iter().flat_map(|q| &q.windows).enumerate() {
                let member_at = at.clone().key("upstream").key("members").index(m);
                windows.push((member_at.key("quota").key("windows").index(j), w));
            }
        }
        for (window_at, w) in windows {
            let Some(unit) = named(&w.unit) else { continue };
            used.insert(unit);
            if usage.and_then(|u| u.unit(unit)).is_none() {
                problems.push((
                    window_at.key("unit"),
                    format!(
                        "unit {:?} is not defined: define it under this route's quota.usage, or count requests",
                        &*unit.0
                    ),
                ));
            }
        }
        let Some(usage) = usage else { continue };
        let usage_at = at.key("quota").key("usage");
        check_settings(&mut problems, &usage_at, usage);
        if usage.units.is_empty() {
            problems.push((
                usage_at.clone(),
                "usage defines no unit: give one, such as tokens: {reserve: ..., settle: ...}, or leave usage out".to_string(),
            ));
        }
        for unit in &usage.units {
            route_units.insert(&unit.name);
            let unit_at = usage_at.clone().key_named(&unit.name.0);
            if !used.contains(&unit.name) && !client_units.contains(&unit.name) {
                problems.push((
                    unit_at.clone(),
                    format!(
                        "unit {:?} is counted by no window: give a window unit: {}, or leave the unit out",
                        &*unit.name.0, &*unit.name.0
                    ),
                ));
            }
            check_amount(
                &mut problems,
                unit_at.clone().key("reserve"),
                &unit.reserve,
                Side::Reserve,
            );
            check_amount(
                &mut problems,
                unit_at.key("settle"),
                &unit.settle,
                Side::Settle,
            );
        }
    }
    if let Some(clients) = &config.clients {
        for (c, client) in clients.list.iter().enumerate() {
            for (j, w) in client.quota.iter().flat_map(|q| &q.windows).enumerate() {
                let Some(unit) = named(&w.unit) else { continue };
                if !route_units.contains(unit) {
                    problems.push((
                        YamlPath::root()
                            .key("clients")
                            .key("list")
                            .index(c)
                            .key("quota")
                            .key("windows")
                            .index(j)
                            .key("unit"),
                        format!(
                            "unit {:?} is defined by no route: define it under the quota.usage of the routes whose usage this window counts",
                            &*unit.0
                        ),
                    ));
                }
            }
        }
    }
    problems
}

fn named(unit: &WindowUnit) -> Option<&UnitName> {
    match unit {
        WindowUnit::Requests => None,
        WindowUnit::Named(n) => Some(n),
    }
}

fn check_settings(problems: &mut Vec<(YamlPath, String)>, at: &YamlPath, usage: &UsageConfig) {
    if usage.max_request_body.get() > MAX_REQUEST_BODY {
        problems.push((
            at.clone().key("max_request_body"),
            format!(
                "max_request_body {} is too large: at most {MAX_REQUEST_BODY} bytes (64 KiB), the most a request keeps for its member once read",
                usage.max_request_body
            ),
        ));
    }
    if usage.max_response_body.get() > MAX_RESPONSE_BODY {
        problems.push((
            at.clone().key("max_response_body"),
            format!(
                "max_response_body {} is too large: at most {MAX_RESPONSE_BODY} bytes (16 MiB), as it is held per request in flight",
                usage.max_response_body
            ),
        ));
    }
    for (j, status) in usage.zero_on.iter().enumerate() {
        if !(100..=599).contains(status) {
            problems.push((
                at.clone().key("zero_on").index(j),
                format!("{status} is not an HTTP status (100 to 599)"),
            ));
        }
    }
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Side {
    Reserve,
    Settle,
}

/// What can be read where: a reservation is made before the answer exists, from the request;
/// a settlement from the answer, when the request is long gone.
fn check_amount(problems: &mut Vec<(YamlPath, String)>, at: YamlPath, amount: &Amount, side: Side) {
    match amount {
        Amount::Sum(parts) => {
            for (k, part) in parts.iter().enumerate() {
                check_amount(problems, at.clone().key("sum").index(k), part, side);
            }
        }
        Amount::Json { default: None, .. } if side == Side::Reserve => problems.push((
            at,
            "a reservation's json needs a default: the amount charged when the body is too large, chunked or not JSON".to_string(),
        )),
        Amount::Header { .. } if side == Side::Reserve => problems.push((
            at.key("header"),
            "header reads a response header, which a reservation is made before; use it under settle".to_string(),
        )),
        Amount::RequestBytes { .. } if side == Side::Settle => problems.push((
            at.key("request_bytes"),
            "request_bytes estimates a reservation; a settlement reads the answer (json or header)".to_string(),
        )),
        _ => {}
    }
}
