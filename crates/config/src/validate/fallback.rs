//! The rules of `fallback` that span routes: each target exists, no chain comes back to a
//! route it left, and none is longer than the gateway follows.

use std::collections::HashMap;

use super::super::position::YamlPath;
use super::super::schema::MAX_FALLBACK_HOPS;
use super::super::Config;

/// The problems of every route's `fallback`.
pub(super) fn problems(config: &Config) -> Vec<(YamlPath, String)> {
    let mut problems = Vec::new();
    let index: HashMap<&str, usize> = config
        .routes
        .iter()
        .enumerate()
        .map(|(i, r)| (r.name.0.as_str(), i))
        .collect();
    for (i, route) in config.routes.iter().enumerate() {
        for (j, entry) in route.fallback.iter().enumerate() {
            let at = YamlPath::root()
                .key("routes")
                .index(i)
                .key("fallback")
                .index(j);
            if entry.on.is_empty() {
                problems.push((
                    at.clone().key("on"),
                    "on is empty, so the request would never go on: list quota_exceeded, no_member, 429 or 503".to_string(),
                ));
            }
            let name = entry.route.0.as_str();
            let Some(&target) = index.get(name) else {
                problems.push((at.key("route"), format!("no route is named {name:?}")));
                continue;
            };
            if let Some(cycle) = cycle_through(config, &index, i, target) {
                problems.push((
                    at.key("route"),
                    format!(
                        "fallback cycle: {}; a request would go round it",
                        cycle.join(" -> ")
                    ),
                ));
                continue;
            }
            let hops = 1 + longest_chain(config, &index, target, 0);
            if hops > MAX_FALLBACK_HOPS {
                problems.push((
                    at.key("route"),
                    format!(
                        "the chain from {:?} through {name:?} is {hops} hops long; at most {MAX_FALLBACK_HOPS} are followed",
                        route.name.0
                    ),
                ));
            }
        }
    }
    problems
}

/// The route names of a path from `to` back to `from`, starting with `from`, if there is one.
fn cycle_through(
    config: &Config,
    index: &HashMap<&str, usize>,
    from: usize,
    to: usize,
) -> Option<Vec<String>> {
    // Depth-first, each route visited once: the routes are finite, so this ends.
    let mut seen = vec![false; config.routes.len()];
    let mut path = vec![from];
    fn walk(
        config: &Config,
        index: &HashMap<&str, usize>,
        at: usize,
        goal: usize,
        seen: &mut [bool],
        path: &mut Vec<usize>,
    ) -> bool {
        path.push(at);
        if at == goal {
            return true;
        }
        if !std::mem::replace(&mut seen[at], true) {
            for entry in &config.routes[at].fallback {
                if let Some(&next) = index.get(entry.route.0.as_str()) {
                    if walk(config, index, next, goal, seen, path) {
                        return true;
                    }
                }
            }
        }
        path.pop();
        false
    }
    walk(config, index, to, from, &mut seen, &mut path).then(|| {
        path.iter()
            .map(|&r| config.routes[r].name.0.clone())
            .collect()
    })
}

/// The most hops a request can make from route `at`. `depth` stops the walk past the bound,
/// so a cycle (reported on its own) does not loop.
fn longest_chain(config: &Config, index: &HashMap<&str, usize>, at: usize, depth: usize) -> usize {
    if depth > MAX_FALLBACK_HOPS {
        return 0;
    }
    config.routes[at]
        .fallback
        .iter()
        .filter_map(|e| index.get(e.route.0.as_str()))
        .map(|&next| 1 + longest_chain(config, index, next, depth + 1))
        .max()
        .unwrap_or(0)
}
