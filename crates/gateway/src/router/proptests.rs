//! The router against a naive reference model of the routing rules.
//!
//! The model scans every (route, host pattern) pair and keeps the best by, in order: the host
//! tier (exact, then wildcards from the longest suffix to the shortest, then `*`), the longest
//! path prefix, config order. That is "exact beats wildcard beats `*`, then the longest prefix,
//! then the method", with a host's routes falling through to the next tier when none of them
//! fits the path and method. Proptest's default case count runs in CI; `scripts/fuzz-long` runs
//! many more.

use proptest::prelude::*;

use super::{RouteMatch, Router};
use crate::config::{HostPattern, MethodName, PathPrefix};

/// Hosts routes name and requests carry, nested so that wildcards overlap.
const HOSTS: &[&str] = &["a.com", "b.a.com", "c.b.a.com", "x.org", "com"];
const REQUEST_HOSTS: &[&str] = &[
    "a.com",
    "b.a.com",
    "c.b.a.com",
    "d.c.b.a.com",
    "x.org",
    "y.x.org",
    "com",
    "other.net",
];
const PREFIXES: &[&str] = &["/", "/v1", "/v1/", "/v1/s", "/v1/search", "/v2/"];
const PATHS: &[&str] = &[
    "/",
    "/v1",
    "/v1/",
    "/v1/search",
    "/v1/search?q=1",
    "/v1x",
    "/v2/",
    "/v2",
    "/other",
];
const METHODS: &[&str] = &["GET", "POST", "DELETE"];

fn pattern() -> impl Strategy<Value = HostPattern> {
    prop_oneof![
        prop::sample::select(HOSTS).prop_map(|h| HostPattern::Exact(h.to_string())),
        prop::sample::select(HOSTS).prop_map(|h| HostPattern::Wildcard(h.to_string())),
        Just(HostPattern::Any),
    ]
}

fn route() -> impl Strategy<Value = RouteMatch> {
    (
        prop::collection::vec(pattern(), 1..3),
        prop::sample::select(PREFIXES),
        prop::sample::subsequence(METHODS, 0..=2),
    )
        .prop_map(|(hosts, prefix, methods)| RouteMatch {
            hosts,
            path_prefix: PathPrefix(prefix.to_string()),
            methods: methods.into_iter().map(|m| MethodName(m.into())).collect(),
        })
}

/// A request host as a client may write it: any case, a port, a trailing dot.
fn request_host() -> impl Strategy<Value = (String, String)> {
    (
        prop::sample::select(REQUEST_HOSTS),
        any::<bool>(),
        prop::option::of(1u16..),
        any::<bool>(),
    )
        .prop_map(|(host, upper, port, dot)| {
            let mut written = if upper {
                host.to_ascii_uppercase()
            } else {
                host.to_string()
            };
            if dot {
                written.push('.');
            }
            if let Some(port) = port {
                written.push_str(&format!(":{port}"));
            }
            (host.to_string(), written)
        })
}

/// The reference: the index of the route SPEC §3 picks for (host, path, method).
fn model(routes: &[RouteMatch], host: &str, path: &str, method: &str) -> Option<usize> {
    let tier = |p: &HostPattern| -> Option<(u8, usize)> {
        match p {
            HostPattern::Exact(h) if h == host => Some((0, 0)),
            // A shorter rest of the host means a longer, more specific suffix.
            HostPattern::Wildcard(s) if host.ends_with(&format!(".{s}")) => {
                Some((1, host.len() - s.len()))
            }
            HostPattern::Any => Some((2, 0)),
            _ => None,
        }
    };
    let mut best: Option<((u8, usize), std::cmp::Reverse<usize>, usize)> = None;
    for (i, r) in routes.iter().enumerate() {
        let fits = path.starts_with(&r.path_prefix.0)
            && (r.methods.is_empty() || r.methods.iter().any(|m| m.0 == method));
        if !fits {
            continue;
        }
        for p in &r.hosts {
            if let Some(t) = tier(p) {
                let key = (t, std::cmp::Reverse(r.path_prefix.0.len()), i);
                if best.as_ref().is_none_or(|b| key < *b) {
                    best = Some(key);
                }
            }
        }
    }
    best.map(|(_, _, i)| i)
}

proptest! {
    #[test]
    fn the_router_agrees_with_the_model(
        routes in prop::collection::vec(route(), 0..8),
        requests in prop::collection::vec(
            (request_host(), prop::sample::select(PATHS), prop::sample::select(METHODS)),
            1..16,
        ),
    ) {
        let router = Router::new(routes.iter().cloned().enumerate().map(|(i, r)| (r, i)));
        for ((host, written), path, method) in requests {
            prop_assert_eq!(
                router.find(&written, path, method).copied(),
                model(&routes, &host, path, method),
                "{} {} {}",
                method,
                written,
                path
            );
        }
    }
}
