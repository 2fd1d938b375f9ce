//! Quotas and least-used pools on a real Redis Cluster (3 masters, 3 replicas): routes whose
//! keys live on different masters, one script call per request, fair counts across two
//! gateways, and a master killed under load.

mod support;

use std::collections::{HashMap, HashSet};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use sluice_testkit::RedisCluster;
use support::{start_backends, Gateway, HttpClient};

fn url(addr: SocketAddr) -> String {
    format!("http://{addr}")
}

fn config(cluster: &RedisCluster, routes: &str) -> String {
    let nodes: Vec<String> = cluster.urls().iter().map(|u| format!("\"{u}\"")).collect();
    format!(
        "listen: [\"{{PROXY}}\"]\nadmin:\n  listen: \"{{ADMIN}}\"\nthreads: 1\nstate:\n  backend: redis\n  redis:\n    cluster: [{}]\n    timeout: 300ms\nroutes:\n{routes}",
        nodes.join(", ")
    )
}

fn route(name: &str, members: &[String], quota: &str) -> String {
    let mut r = format!(
        "  - name: {name}\n    match:\n      hosts: [\"{name}.test\"]\n    upstream:\n      selection: least_used\n      members:\n"
    );
    for m in members {
        r.push_str(&format!("        - url: \"{m}\"\n"));
    }
    r.push_str("    quota:\n");
    r.push_str(quota);
    r
}

/// Route names whose keys (hash tag `{name}`) sit on pairwise different masters, `n` of them.
fn names_on_distinct_masters(cluster: &RedisCluster, n: usize) -> Vec<String> {
    let mut seen = HashSet::new();
    let mut names = Vec::new();
    for i in 0..200 {
        let name = format!("r{i}");
        let Some(master) = cluster.master_of(&format!("{{{name}}}")) else {
            continue;
        };
        if seen.insert(master) {
            names.push(name);
            if names.len() == n {
                break;
            }
        }
    }
    names
}

fn pool_counts(cluster: &RedisCluster, route: &str) -> Vec<u64> {
    let key = format!("sluice:{{{route}}}:pool");
    let port = cluster.master_of(&key).unwrap();
    cluster.nodes()[cluster.index_of(port)]
        .zrange_with_scores(&key)
        .into_iter()
        .map(|(_, c)| c as u64)
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn routes_on_different_masters_each_cost_one_script_call_and_stay_fair() {
    let cluster = RedisCluster::start();
    let names = names_on_distinct_masters(&cluster, 3);
    assert_eq!(names.len(), 3, "three routes, one per master");
    let backends = start_backends(&["m1", "m2", "m3"]).await;
    let members: Vec<String> = backends.iter().map(|b| url(b.local_addr())).collect();
    let quota = "      windows:\n        - {name: minute, limit: 1000000, window: 1m}\n";
    let routes: String = names.iter().map(|n| route(n, &members, quota)).collect();
    let yaml = config(&cluster, &routes);
    let gateways = [
        Gateway::start_with_ports(&yaml),
        Gateway::start_with_ports(&yaml),
    ];
    // Warm up: pools synced, scripts loaded on the masters.
    for gw in &gateways {
        for n in &names {
            let r =
                support::request(gw.proxy_addr(), "GET", &format!("{n}.test"), "/", &[], b"").await;
            assert_eq!(r.status, 200, "{}", r.text());
        }
    }

    let monitors: Vec<_> = cluster
        .masters()
        .iter()
        .map(|&p| cluster.nodes()[cluster.index_of(p)].monitor())
        .collect();
    let mut tasks = Vec::new();
    for c in 0..32 {
        let addr = gateways[c % 2].proxy_addr();
        let host = format!("{}.test", names[c % 3]);
        tasks.push(tokio::spawn(async move {
            let mut client = HttpClient::connect(addr).await.unwrap();
            let mut bad = 0;
            for _ in 0..40 {
                if client
                    .request("GET", &host, "/", &[], b"")
                    .await
                    .map_or(0, |r| r.status)
                    != 200
                {
                    bad += 1;
                }
            }
            bad
        }));
    }
    let mut bad = 0;
    for t in tasks {
        bad += t.await.unwrap();
    }
    let sent: Vec<String> = monitors.into_iter().flat_map(|m| m.stop()).collect();
    assert_eq!(bad, 0);
    assert_eq!(
        sent.len(),
        32 * 40,
        "one command per request across the masters"
    );
    assert!(
        sent.iter().all(|c| c == "EVALSHA"),
        "{:?}",
        sent.iter().collect::<HashSet<_>>()
    );
    for n in &names {
        let counts = pool_counts(&cluster, n);
        let spread = counts.iter().max().unwrap() - counts.iter().min().unwrap();
        assert!(spread <= 1, "route {n}: {counts:?}");
    }
    for gw in &gateways {
        assert!(!gw.logs().contains("CROSSSLOT"), "{}", gw.logs());
    }
}

/// What one client saw: (route, status, when).
type Seen = Arc<Mutex<Vec<(&'static str, u16, Instant)>>>;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_master_killed_under_load() {
    const LIMIT: u64 = 300;
    let mut cluster = RedisCluster::start();
    // Two routes on the same master: one fails open, one fails closed.
    let mut by_master: HashMap<u16, Vec<String>> = HashMap::new();
    for i in 0..200 {
        let name = format!("f{i}");
        if let Some(m) = cluster.master_of(&format!("{{{name}}}")) {
            by_master.entry(m).or_default().push(name);
        }
    }
    let (victim, pair) = by_master.into_iter().find(|(_, v)| v.len() >= 2).unwrap();
    let (open_name, closed_name) = (pair[0].clone(), pair[1].clone());
    let backends = start_backends(&["m1", "m2", "m3"]).await;
    let members: Vec<String> = backends.iter().map(|b| url(b.local_addr())).collect();
    let open_quota = "      windows:\n        - {name: minute, limit: 1000000, window: 1m}\n      on_store_error: open\n";
    let closed_quota = format!("      windows:\n        - {{name: minute, limit: {LIMIT}, window: 1m}}\n      on_store_error: closed\n");
    let routes =
        route(&open_name, &members, open_quota) + &route(&closed_name, &members, &closed_quota);
    let yaml = config(&cluster, &routes);
    let gateways = [
        Gateway::start_with_ports(&yaml),
        Gateway::start_with_ports(&yaml),
    ];

    let seen: Seen = Arc::default();
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut tasks = Vec::new();
    for c in 0..8 {
        let addr = gateways[c % 2].proxy_addr();
        let (which, host): (&'static str, String) = if c % 4 < 2 {
            ("open", format!("{open_name}.test"))
        } else {
            ("closed", format!("{closed_name}.test"))
        };
        let (seen, stop) = (seen.clone(), stop.clone());
        tasks.push(tokio::spawn(async move {
            let mut client = HttpClient::connect(addr).await.unwrap();
            // Bounded: at most 3,000 requests per client.
            for _ in 0..3000 {
                if stop.load(std::sync::atomic::Ordering::Relaxed) {
                    break;
                }
                let status = client
                    .request("GET", &host, "/", &[], b"")
                    .await
                    .map_or(0, |r| r.status);
                seen.lock().unwrap().push((which, status, Instant::now()));
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        }));
    }
    tokio::time::sleep(Duration::from_millis(1000)).await;
    let killed_at = Instant::now();
    cluster.kill(cluster.index_of(victim));
    // Run until the closed route has been served again for a while, at most 20 s.
    // Served again means the store answers again: an admission (200) or a refusal by the
    // quota (429, once the limit is spent), not store_unavailable.
    let recovered = support::wait_until(Duration::from_secs(20), || {
        seen.lock().unwrap().iter().any(|&(w, s, t)| {
            w == "closed" && (s == 200 || s == 429) && t > killed_at + Duration::from_millis(1500)
        })
    })
    .await;
    tokio::time::sleep(Duration::from_millis(1000)).await;
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    for t in tasks {
        t.await.unwrap();
    }
    let seen = seen.lock().unwrap();
    let count =
        |w: &str, f: &dyn Fn(u16) -> bool| seen.iter().filter(|&&(x, s, _)| x == w && f(s)).count();
    let open_failed = count("open", &|s| s != 200);
    let closed_503: Vec<Instant> = seen
        .iter()
        .filter(|&&(w, s, _)| w == "closed" && s == 503)
        .map(|&(_, _, t)| t)
        .collect();
    let closed_ok = count("closed", &|s| s == 200) as u64;
    let closed_other = count("closed", &|s| ![200, 429, 503].contains(&s));
    let first_ok_after = seen
        .iter()
        .filter(|&&(w, s, t)| w == "closed" && (s == 200 || s == 429) && t > killed_at)
        .filter(|&&(_, _, t)| closed_503.iter().all(|&f| t > f))
        .map(|&(_, _, t)| t)
        .min();
    let window_ms = closed_503
        .iter()
        .max()
        .map_or(0, |&last| last.duration_since(killed_at).as_millis());
    let serving_ms = first_ok_after.map(|t| t.duration_since(killed_at).as_millis());
    let over_admitted = closed_ok.saturating_sub(LIMIT);
    println!(
        "FAILOVER: open route {} requests, {open_failed} failed; closed route {} requests: {} answered 503 within {window_ms} ms of the kill, {closed_ok} admitted against a limit of {LIMIT} (over-admitted {over_admitted}), other {closed_other}; replica serving after {serving_ms:?} ms",
        count("open", &|_| true),
        count("closed", &|_| true),
        closed_503.len()
    );
    assert!(recovered, "the replica must take over");
    assert_eq!(
        open_failed, 0,
        "an open route fails no request during a failover"
    );
    assert_eq!(closed_other, 0);
    assert!(
        closed_503.iter().all(|&t| t >= killed_at),
        "503s only during the failover"
    );
    for gw in &gateways {
        assert!(!gw.logs().contains("panicked"), "{}", gw.logs());
    }
}
