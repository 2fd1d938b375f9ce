//! Request routing (SPEC §3): by host, then the longest path prefix, then method.
//!
//! Exact hosts sit in a hash map and wildcards in another, keyed by their suffix, so a lookup
//! costs a few hash probes whatever the number of routes. Within one host, candidates are kept
//! sorted by prefix length, longest first. When no candidate of an exact host fits the path or
//! method, matching falls through to the wildcards and then to `*`, the way Kong and Traefik
//! treat routes as independent rules rather than NGINX-style server blocks.

use std::borrow::Cow;
use std::collections::HashMap;

use crate::config::{HostPattern, MethodName, PathPrefix};

/// What one route asks of a request.
#[derive(Debug, Clone)]
pub struct RouteMatch {
    /// Host patterns.
    pub hosts: Vec<HostPattern>,
    /// Path prefix.
    pub path_prefix: PathPrefix,
    /// Allowed methods; empty means all.
    pub methods: Vec<MethodName>,
}

#[derive(Debug)]
struct Candidate<T> {
    prefix: Box<str>,
    methods: Box<[Box<str>]>,
    target: T,
}

impl<T> Candidate<T> {
    fn accepts(&self, path: &str, method: &str) -> bool {
        path.starts_with(&*self.prefix)
            && (self.methods.is_empty() || self.methods.iter().any(|m| &**m == method))
    }
}

/// An immutable routing table from requests to `T`.
#[derive(Debug)]
pub struct Router<T> {
    exact: HashMap<Box<str>, Vec<Candidate<T>>>,
    wildcard: HashMap<Box<str>, Vec<Candidate<T>>>,
    any: Vec<Candidate<T>>,
}

impl<T: Clone> Router<T> {
    /// Builds the table. Among candidates with equally long prefixes, config order decides.
    pub fn new(routes: impl IntoIterator<Item = (RouteMatch, T)>) -> Router<T> {
        let mut router = Router {
            exact: HashMap::new(),
            wildcard: HashMap::new(),
            any: Vec::new(),
        };
        for (m, target) in routes {
            for host in &m.hosts {
                let candidate = Candidate {
                    prefix: m.path_prefix.0.clone().into_boxed_str(),
                    methods: m.methods.iter().map(|x| x.0.clone().into()).collect(),
                    target: target.clone(),
                };
                let bucket = match host {
                    HostPattern::Any => &mut router.any,
                    HostPattern::Exact(h) => router.exact.entry(h.clone().into()).or_default(),
                    HostPattern::Wildcard(s) => {
                        router.wildcard.entry(s.clone().into()).or_default()
                    }
                };
                bucket.push(candidate);
            }
        }
        let longest_first = |v: &mut Vec<Candidate<T>>| {
            // A stable sort keeps config order among equal prefixes.
            v.sort_by_key(|c| std::cmp::Reverse(c.prefix.len()));
        };
        router.exact.values_mut().for_each(longest_first);
        router.wildcard.values_mut().for_each(longest_first);
        longest_first(&mut router.any);
        router
    }
}

impl<T> Router<T> {
    /// Finds the route for a request. `host` may carry a port and any case; `path` is the
    /// origin-form path (a query string is harmless: prefixes never contain `?`).
    pub fn find(&self, host: &str, path: &str, method: &str) -> Option<&T> {
        self.find_normalized(&normalize_host(host), path, method)
    }

    /// Like [`Router::find`], for a host already in the form routes match (see
    /// [`crate::target::Target::host`]).
    pub fn find_normalized(&self, host: &str, path: &str, method: &str) -> Option<&T> {
        self.find_with(host, path, Some(method))
    }

    /// The route a request would take if its method were allowed: for the `Allow` header of
    /// a 405.
    pub fn find_any_method(&self, host: &str, path: &str) -> Option<&T> {
        self.find_with(host, path, None)
    }

    fn find_with(&self, host: &str, path: &str, method: Option<&str>) -> Option<&T> {
        fn pick<'a, T>(
            bucket: &'a [Candidate<T>],
            path: &str,
            method: Option<&str>,
        ) -> Option<&'a T> {
            bucket
                .iter()
                .find(|c| match method {
                    Some(method) => c.accepts(path, method),
                    None => path.starts_with(&*c.prefix),
                })
                .map(|c| &c.target)
        }
        if let Some(t) = self.exact.get(host).and_then(|b| pick(b, path, method)) {
            return Some(t);
        }
        // The most specific wildcard first: for a.b.example.com, try b.example.com, then
        // example.com, then com. Without wildcard routes there is nothing to walk for (the
        // walk's searches for dots cost about 400 instructions a request).
        if !self.wildcard.is_empty() {
            let mut rest: &str = host;
            while let Some(dot) = rest.find('.') {
                rest = &rest[dot + 1..];
                if let Some(t) = self.wildcard.get(rest).and_then(|b| pick(b, path, method)) {
                    return Some(t);
                }
            }
        }
        pick(&self.any, path, method)
    }
}

/// Lowercases and strips the port and a trailing dot; allocates only when the host is not
/// already in that form, which clients rarely get wrong.
pub fn normalize_host(host: &str) -> Cow<'_, str> {
    let without_port = if let Some(v6) = host.strip_prefix('[') {
        v6.split(']').next().unwrap_or(v6)
    } else if host.bytes().filter(|&b| b == b':').count() > 1 {
        // A bare IPv6 literal: its last colon is not a port.
        host
    } else {
        match host.rfind(':') {
            Some(i) if host[i + 1..].bytes().all(|b| b.is_ascii_digit()) => &host[..i],
            _ => host,
        }
    };
    if without_port.contains(':') {
        // IPv6 has many spellings of one address; the config stores the canonical one.
        if let Ok(v6) = without_port.parse::<std::net::Ipv6Addr>() {
            let canonical = v6.to_string();
            return if canonical == without_port {
                Cow::Borrowed(without_port)
            } else {
                Cow::Owned(canonical)
            };
        }
    }
    let trimmed = without_port.strip_suffix('.').unwrap_or(without_port);
    if trimmed.bytes().any(|b| b.is_ascii_uppercase()) {
        Cow::Owned(trimmed.to_ascii_lowercase())
    } else {
        Cow::Borrowed(trimmed)
    }
}

#[cfg(test)]
mod proptests;

#[cfg(test)]
mod tests {
    use super::*;

    fn m(hosts: &[&str], prefix: &str, methods: &[&str]) -> RouteMatch {
        let hosts = hosts
            .iter()
            .map(|h| match *h {
                "*" => HostPattern::Any,
                h if h.starts_with("*.") => HostPattern::Wildcard(h[2..].to_string()),
                h => HostPattern::Exact(h.to_string()),
            })
            .collect();
        RouteMatch {
            hosts,
            path_prefix: PathPrefix(prefix.into()),
            methods: methods.iter().map(|x| MethodName(x.to_string())).collect(),
        }
    }

    fn router() -> Router<&'static str> {
        Router::new([
            (m(&["api.example.com"], "/", &[]), "api-root"),
            (m(&["api.example.com"], "/v1/", &[]), "api-v1"),
            (
                m(&["api.example.com"], "/v1/search", &["GET"]),
                "api-search-get",
            ),
            (m(&["*.example.com"], "/", &[]), "wild"),
            (m(&["*.deep.example.com"], "/", &[]), "deep-wild"),
            (m(&["other.test"], "/only/", &[]), "other"),
            (m(&["*"], "/fallback/", &[]), "any"),
        ])
    }

    #[test]
    fn longest_prefix_then_method() {
        let r = router();
        assert_eq!(
            r.find("api.example.com", "/v1/search?q=1", "GET"),
            Some(&"api-search-get")
        );
        assert_eq!(
            r.find("api.example.com", "/v1/search", "POST"),
            Some(&"api-v1")
        );
        assert_eq!(r.find("api.example.com", "/v1/x", "GET"), Some(&"api-v1"));
        assert_eq!(r.find("api.example.com", "/v2", "GET"), Some(&"api-root"));
    }

    #[test]
    fn exact_beats_wildcard_and_wildcards_need_a_subdomain() {
        let r = router();
        assert_eq!(r.find("a.example.com", "/", "GET"), Some(&"wild"));
        assert_eq!(r.find("x.a.example.com", "/", "GET"), Some(&"wild"));
        assert_eq!(r.find("x.deep.example.com", "/", "GET"), Some(&"deep-wild"));
        assert_eq!(r.find("example.com", "/", "GET"), None);
    }

    #[test]
    fn host_case_port_and_trailing_dot_are_ignored() {
        let r = router();
        assert_eq!(
            r.find("API.Example.COM:8443", "/v1/", "GET"),
            Some(&"api-v1")
        );
        assert_eq!(r.find("api.example.com.", "/", "GET"), Some(&"api-root"));
    }

    #[test]
    fn ipv6_literals_match_with_or_without_brackets_and_port() {
        // The config stores `::1` however it was written (see HostPattern); requests carry
        // `[::1]:8080` in Host or in an absolute URI.
        let r = Router::new([
            (m(&["::1"], "/", &[]), "loopback"),
            (m(&["2001:db8::a"], "/", &[]), "doc"),
        ]);
        for host in ["[::1]:8080", "[::1]", "::1", "[0:0:0:0:0:0:0:1]:80"] {
            assert_eq!(r.find(host, "/", "GET"), Some(&"loopback"), "{host}");
        }
        for host in ["[2001:DB8::A]:443", "2001:db8:0::a"] {
            assert_eq!(r.find(host, "/", "GET"), Some(&"doc"), "{host}");
        }
        assert_eq!(r.find("[::2]:8080", "/", "GET"), None);
    }

    #[test]
    fn no_match_falls_through_to_any_then_none() {
        let r = router();
        assert_eq!(r.find("other.test", "/only/x", "GET"), Some(&"other"));
        assert_eq!(r.find("other.test", "/fallback/x", "GET"), Some(&"any"));
        assert_eq!(r.find("unknown.test", "/x", "GET"), None);
    }

    #[test]
    fn ten_thousand_routes_build_and_match() {
        let routes: Vec<(RouteMatch, usize)> = (0..10_000)
            .map(|i| (m(&[&format!("h{i}.example.net")], "/", &[]), i))
            .collect();
        let r = Router::new(routes);
        assert_eq!(r.find("h9999.example.net", "/", "GET"), Some(&9999));
        assert_eq!(r.find("h10000.example.net", "/", "GET"), None);
    }
}
