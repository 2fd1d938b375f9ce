//! `Router::find` with 10 and 10,000 routes.
//!
//! Run: `cargo bench -p sluice-gateway --bench router -- --warm-up-time 1 --measurement-time 3`.
//!
//! Each table holds `n` routes: `n - n/10` exact hosts (`h{i}.example.net`) and `n/10` wildcards
//! (`*.w{i}.example.org`), all on path prefix `/`, and no `*` route, so a miss really misses.

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use sluice_gateway::config::{HostPattern, PathPrefix};
use sluice_gateway::router::{RouteMatch, Router};

fn route(host: HostPattern) -> RouteMatch {
    RouteMatch {
        hosts: vec![host],
        path_prefix: PathPrefix("/".to_string()),
        methods: Vec::new(),
    }
}

fn table(n: usize) -> Router<usize> {
    let wildcards = n / 10;
    let exact = n - wildcards;
    let routes = (0..exact)
        .map(|i| route(HostPattern::Exact(format!("h{i}.example.net"))))
        .chain((0..wildcards).map(|i| route(HostPattern::Wildcard(format!("w{i}.example.org")))))
        .enumerate()
        .map(|(i, m)| (m, i));
    Router::new(routes)
}

fn bench_find(c: &mut Criterion) {
    let mut group = c.benchmark_group("router_find");
    for n in [10usize, 10_000] {
        let router = table(n);
        let exact = n - n / 10;
        let last_exact = format!("h{}.example.net", exact - 1);
        let last_wild = format!("api.w{}.example.org", n / 10 - 1);
        let cases: [(&str, &str, Option<usize>); 4] = [
            ("exact", &last_exact, Some(exact - 1)),
            // Uppercase and a port: the host is normalised into a new String first.
            (
                "exact_case_port",
                &last_exact.to_uppercase(),
                Some(exact - 1),
            ),
            ("wildcard", &last_wild, Some(n - 1)),
            ("miss", "nope.example.com", None),
        ];
        for (name, host, expected) in cases {
            let host = if name == "exact_case_port" {
                format!("{host}:443")
            } else {
                host.to_string()
            };
            assert_eq!(router.find(&host, "/v1/x", "GET").copied(), expected);
            group.bench_function(BenchmarkId::new(name, n), |b| {
                b.iter(|| {
                    black_box(router.find(black_box(&host), black_box("/v1/x"), black_box("GET")))
                })
            });
        }
    }
    group.finish();
}

criterion_group!(benches, bench_find);
criterion_main!(benches);
