//! Quotas and least-used pools on a real Redis Cluster (3 masters, 3 replicas): routes whose
//! keys live on different masters, at most one script call per request, fair counts across two
//! gateways, and a master killed under load.

mod support;

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use sluice_testkit::RedisCluster;
use support::{start_backends, url, Config, HttpClient, Quota, Route, State};

/// A config on `cluster` with `routes`, and the Redis call `timeout`.
fn config(
    cluster: &RedisCluster,
    timeout: &str,
    routes: impl IntoIterator<Item = Route>,
) -> Config {
    Config::new()
        .state(State::cluster(cluster.urls()).timeout(timeout))
        .routes(routes)
}

/// A least-used route `name` (host `<name>.test`) over `members` with `quota`.
fn route(name: &str, members: &[String], quota: Quota) -> Route {
    Route::new(name).least_used().members(members).quota(quota)
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
async fn routes_on_different_masters_cost_at_most_one_script_call_a_request_and_stay_fair() {
    let cluster = RedisCluster::start();
    let names = names_on_distinct_masters(&cluster, 3);
    assert_eq!(names.len(), 3, "three routes, one per master");
    let backends = start_backends(&["m1", "m2", "m3"]).await;
    let members: Vec<String> = backends.iter().map(|b| url(b.local_addr())).collect();
    let quota = Quota::window("minute", 1_000_000, "1m");
    let config = config(
        &cluster,
        support::config::REDIS_TIMEOUT,
        names.iter().map(|n| route(n, &members, quota.clone())),
    );
    let gateways = [config.start(), config.start()];
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
    // Requests of one route that wait together share a call (crates/store/src/batch.rs).
    assert!(
        !sent.is_empty() && sent.len() <= 32 * 40,
        "at most one command per request across the masters: {}",
        sent.len()
    );
    assert!(
        sent.iter().all(|c| c == "FCALL"),
        "{:?}",
        sent.iter().collect::<HashSet<_>>()
    );
    let mut counted = 0;
    for n in &names {
        let counts = pool_counts(&cluster, n);
        let spread = counts.iter().max().unwrap() - counts.iter().min().unwrap();
        assert!(spread <= 1, "route {n}: {counts:?}");
        counted += counts.iter().sum::<u64>();
    }
    // Every request (the warm-up's too) counted once, whatever call decided it.
    assert_eq!(counted, 32 * 40 + 2 * 3, "assignments counted");
    for gw in &gateways {
        assert!(!gw.logs().contains("CROSSSLOT"), "{}", gw.logs());
    }
}

/// One answer a client got: its route, its status, when the request was sent and when the
/// answer came.
#[derive(Clone, Copy)]
struct Seen {
    route: &'static str,
    status: u16,
    sent: Instant,
    answered: Instant,
}

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
    let replica = cluster
        .replica_of(victim)
        .expect("the victim has a replica");
    let (open_name, closed_name) = (pair[0].clone(), pair[1].clone());
    let backends = start_backends(&["m1", "m2", "m3"]).await;
    let members: Vec<String> = backends.iter().map(|b| url(b.local_addr())).collect();
    // The closed route's window outlasts the test, so no admission ever leaves it: whatever
    // happens, it may admit LIMIT requests in all, and no more.
    let config = config(
        &cluster,
        // Shorter than the failover (about 5 s), so that requests during it get the store
        // error rather than waiting it out; long enough that a loaded machine does not fail a
        // call before it (at 1 s one could: a 503 before the kill, and an admission lost).
        "3s",
        [
            route(
                &open_name,
                &members,
                Quota::window("minute", 1_000_000, "1m").on_store_error("open"),
            ),
            route(
                &closed_name,
                &members,
                Quota::window("hour", LIMIT, "1h").on_store_error("closed"),
            ),
        ],
    );
    let gateways = [config.start(), config.start()];

    let seen: Arc<Mutex<Vec<Seen>>> = Arc::default();
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut tasks = Vec::new();
    for c in 0..8 {
        let addr = gateways[c % 2].proxy_addr();
        let (route, host): (&'static str, String) = if c % 4 < 2 {
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
                let sent = Instant::now();
                let status = client
                    .request("GET", &host, "/", &[], b"")
                    .await
                    .map_or(0, |r| r.status);
                let answered = Instant::now();
                seen.lock().unwrap().push(Seen {
                    route,
                    status,
                    sent,
                    answered,
                });
                // Not a synchronisation: pacing, so eight clients do not starve two cores.
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        }));
    }
    let count = |f: &dyn Fn(&Seen) -> bool| seen.lock().unwrap().iter().filter(|s| f(s)).count();

    // Kill the master once the closed route has spent its quota (it answers 429) and the
    // replica holds every one of its admissions: from then on the closed route has nothing
    // left to admit, so any admission after the failover would be an over-admission, and no
    // replication lag can excuse one.
    let closed_log = format!("sluice:{{{closed_name}}}:q:hour:route");
    let spent = support::wait_until(Duration::from_secs(30), || {
        count(&|s| s.route == "closed" && s.status == 429) > 0
            && cluster.replica_log_held(replica, &closed_log) == Some(LIMIT)
    })
    .await;
    assert!(
        spent,
        "the closed route spends its quota and the replica has it all: {:?} on the replica",
        cluster.replica_log_held(replica, &closed_log)
    );
    // Every node learns the short timeout before the kill, so the replica is promoted within
    // the deadlines below; until now no stall of a loaded machine could fail a master over.
    cluster.fail_over_after(Duration::from_secs(3));
    cluster.kill(cluster.index_of(victim));
    let killed_at = Instant::now();
    // A request sent after the kill and answered by the store (an admission or a refusal by
    // the quota, not store_unavailable) was answered by the promoted replica.
    let served_again = |s: &Seen| {
        s.route == "closed" && s.sent > killed_at && (s.status == 200 || s.status == 429)
    };
    let recovered = support::wait_until(Duration::from_secs(20), || count(&served_again) > 0).await;
    // Then keep the load on until each route has had 40 more answers from the new master.
    let recovered_at = Instant::now();
    let tail = support::wait_until(Duration::from_secs(20), || {
        ["open", "closed"]
            .iter()
            .all(|&r| count(&|s| s.route == r && s.sent > recovered_at) >= 40)
    })
    .await;
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    for t in tasks {
        t.await.unwrap();
    }
    let seen = seen.lock().unwrap().clone();
    let count = |r: &str, f: &dyn Fn(u16) -> bool| {
        seen.iter().filter(|s| s.route == r && f(s.status)).count()
    };
    let open_failed = count("open", &|s| s != 200);
    let closed_503: Vec<&Seen> = seen
        .iter()
        .filter(|s| s.route == "closed" && s.status == 503)
        .collect();
    let closed_ok = count("closed", &|s| s == 200) as u64;
    let closed_other = count("closed", &|s| ![200, 429, 503].contains(&s));
    let first_served_after = seen
        .iter()
        .filter(|s| served_again(s))
        .map(|s| s.answered)
        .min();
    let window_ms = closed_503
        .iter()
        .map(|s| s.answered)
        .max()
        .map_or(0, |last| last.duration_since(killed_at).as_millis());
    let serving_ms = first_served_after.map(|t| t.duration_since(killed_at).as_millis());
    println!(
        "FAILOVER: open route {} requests, {open_failed} failed; closed route {} requests: {} answered 503 within {window_ms} ms of the kill, {closed_ok} admitted against a limit of {LIMIT}, other {closed_other}; replica serving after {serving_ms:?} ms",
        count("open", &|_| true),
        count("closed", &|_| true),
        closed_503.len()
    );
    assert!(recovered, "the replica must take over");
    assert!(tail, "both routes keep being served after the failover");
    assert_eq!(
        open_failed, 0,
        "an open route fails no request during a failover"
    );
    assert_eq!(closed_other, 0);
    assert!(
        closed_503.iter().all(|s| s.answered >= killed_at),
        "503s only during the failover"
    );
    assert_eq!(
        closed_ok, LIMIT,
        "the closed route admits exactly its limit: no admission was lost, none came twice"
    );
    assert_eq!(
        cluster.master_of(&closed_log).map(|m| m == replica),
        Some(true),
        "the replica is the new master"
    );
    for gw in &gateways {
        assert!(!gw.logs().contains("panicked"), "{}", gw.logs());
    }
}
