//! A hot route kept as sub-logs (`state_shards: 3`), through the real gateway: exactly the limit
//! admitted across two gateways on one Redis and on a 3-master Redis Cluster (each sub-log holding
//! its share, in a slot of its own, on three masters of the cluster), `/status` summing the
//! sub-logs, least-used totals within three of each other, and the memory store keeping one log;
//! a route's `max_in_flight` split over the sub-logs, each lease released in the sub-log that
//! took it; with `state_shards_start: home`, each gateway's requests in its own sub-log until
//! its share is spent, then in the others, exactly the limit in all; and a reload into `home`
//! on an instance started without an index taking the sub-logs in turn, as it logs.

mod support;

use std::collections::HashSet;
use std::time::Duration;

use sluice_testkit::{RedisCluster, RedisServer};
use support::{
    start_backends, url, Backend, Config, Gateway, HttpClient, Quota, Route, State, Store,
};

const LIMIT: u64 = 40;
const SHARDS: u64 = 3;

on_both_stores!(
    sub_logs_admit_exactly_the_limit,
    each_gateway_starts_at_its_own_sub_log
);

/// A least-used route `name` over `members` with a quota of `LIMIT` an hour, in three sub-logs.
fn hot(name: &str, members: &[String]) -> Route {
    Route::new(name)
        .least_used()
        .members(members)
        .quota(Quota::window("hour", LIMIT, "1h"))
        .state_shards(SHARDS as u32)
}

/// Per sub-log of route `route`, in order, what its hour log holds (requests of cost 1), found
/// by the sub-log's own name.
fn sub_logs_held(redis: &RedisServer, route: &str) -> Vec<u64> {
    (0..SHARDS as u32)
        .map(|i| {
            let name = sluice_store::keys::sub_log(route, i, SHARDS as u32);
            let pattern = format!("sluice:{{{name}}}:q:hour:*");
            let keys = redis.command(&["KEYS", &pattern]).unwrap();
            keys.lines()
                .filter(|k| !k.is_empty())
                .map(|k| redis.log_held(k))
                .sum()
        })
        .collect()
}

/// 16 clients, 10 requests each, spread over `gateways` on host `host`: the statuses.
async fn burst(gateways: &[Gateway], host: &str) -> Vec<u16> {
    let mut tasks = Vec::new();
    for c in 0..16 {
        let addr = gateways[c % gateways.len()].proxy_addr();
        let host = host.to_string();
        tasks.push(tokio::spawn(async move {
            let mut client = HttpClient::connect(addr).await.unwrap();
            let mut statuses = Vec::new();
            for _ in 0..10 {
                let r = client.request("GET", &host, "/", &[], b"").await;
                statuses.push(r.map_or(0, |r| r.status));
            }
            statuses
        }));
    }
    let mut statuses = Vec::new();
    for t in tasks {
        statuses.extend(t.await.unwrap());
    }
    statuses
}

/// Exactly `LIMIT` of the 160 requests admitted, the rest refused with 429, only the admitted
/// reaching a member; `/status` shows nothing left, and assignment counts that add up to the
/// limit and differ by at most the sub-logs' count.
async fn admitted_exactly(gateways: &[Gateway], host: &str) {
    let statuses = burst(gateways, host).await;
    let admitted = statuses.iter().filter(|&&s| s == 200).count() as u64;
    let refused = statuses.iter().filter(|&&s| s == 429).count() as u64;
    assert_eq!(admitted + refused, 160, "every request is 200 or 429");
    assert_eq!(admitted, LIMIT, "exactly the limit, across the sub-logs");
    let status = gateways[0].status().await;
    let route = &status["routes"][0];
    assert_eq!(route["quota"][0]["remaining"], 0, "{route}");
    let counts: Vec<u64> = route["members"]
        .as_array()
        .expect("members")
        .iter()
        .map(|m| m["assignments"].as_u64().expect("assignments"))
        .collect();
    assert_eq!(counts.iter().sum::<u64>(), LIMIT, "{counts:?}");
    let spread = counts.iter().max().unwrap() - counts.iter().min().unwrap();
    assert!(
        spread <= SHARDS,
        "least-used totals within the sub-logs' count: {counts:?}"
    );
}

async fn sub_logs_admit_exactly_the_limit(backend: Backend) {
    let store = Store::start(backend);
    let backends = start_backends(&["b1", "b2", "b3"]).await;
    let members: Vec<String> = backends.iter().map(|b| url(b.local_addr())).collect();
    let config = Config::new().store(&store).route(hot("api", &members));
    let gateways: Vec<Gateway> = (0..store.instances()).map(|_| config.start()).collect();
    admitted_exactly(&gateways, "api.test").await;
    assert_eq!(
        backends.iter().map(|b| b.proxied_requests()).sum::<u64>(),
        LIMIT,
        "only the admitted requests reach a member"
    );
    let Some(redis) = store.redis() else {
        return;
    };
    // On Redis, the three sub-logs' hour logs, each filled to its share (14 + 13 + 13).
    let keys = redis.command(&["KEYS", "sluice:{api*:q:hour:*"]).unwrap();
    let mut held: Vec<u64> = keys
        .lines()
        .filter(|k| !k.is_empty())
        .map(|k| redis.log_held(k))
        .collect();
    held.sort_unstable();
    assert_eq!(held, [13, 13, 14], "{keys}");
}

/// `state_shards_start: home`, two gateways of `instance_index` 0 and 1 on Redis: each one's
/// requests land in its own sub-log (0, the route's own keys, and 1); a burst from both past
/// the limit goes on to the others, sub-log 2 (neither's own) among them, and exactly the limit
/// is admitted in all. On the memory store (one log whatever the route says), one gateway
/// admits exactly the limit too.
async fn each_gateway_starts_at_its_own_sub_log(backend: Backend) {
    let store = Store::start(backend);
    let backends = start_backends(&["b1", "b2", "b3"]).await;
    let members: Vec<String> = backends.iter().map(|b| url(b.local_addr())).collect();
    let route = hot("api", &members).state_shards_start("home");
    let gateways: Vec<Gateway> = (0..store.instances())
        .map(|i| {
            let state = match store.redis() {
                Some(_) => store.state().instance_index(i as u32),
                None => store.state(),
            };
            Config::new().state(state).route(route.clone()).start()
        })
        .collect();
    let mut before = 0;
    if let Some(redis) = store.redis() {
        for (gateway, n) in [(0, 5), (1, 4)] {
            for _ in 0..n {
                let addr = gateways[gateway].proxy_addr();
                let r = support::request(addr, "GET", "api.test", "/", &[], b"").await;
                assert_eq!(r.status, 200, "{}", r.text());
            }
        }
        assert_eq!(
            sub_logs_held(redis, "api"),
            [5, 4, 0],
            "gateway 0's requests in sub-log 0, gateway 1's in sub-log 1"
        );
        before = 9;
    }
    let statuses = burst(&gateways, "api.test").await;
    let admitted = statuses.iter().filter(|&&s| s == 200).count() as u64;
    assert_eq!(
        statuses.iter().filter(|&&s| s == 429).count() as u64 + admitted,
        160
    );
    assert_eq!(admitted + before, LIMIT, "exactly the limit, never more");
    assert_eq!(
        backends.iter().map(|b| b.proxied_requests()).sum::<u64>(),
        LIMIT
    );
    let Some(redis) = store.redis() else {
        return;
    };
    let keys = redis.command(&["KEYS", "sluice:{api*:q:hour:*"]).unwrap();
    let mut held: Vec<u64> = keys
        .lines()
        .filter(|k| !k.is_empty())
        .map(|k| redis.log_held(k))
        .collect();
    held.sort_unstable();
    assert_eq!(held, [13, 13, 14], "each sub-log to its share: {keys}");
}

/// A gateway started on Redis without `instance_index`, then reloaded into `state_shards_start:
/// home` by a file that sets an index too (state settings apply at a restart, so the running
/// store keeps having none): the reload is taken and logs that the route takes its sub-logs in
/// turn until a restart, and it does: six requests one after another land two in each sub-log,
/// where `home` would have put all six in one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_into_home_without_an_instance_index_takes_the_sub_logs_in_turn() {
    let store = Store::start(Backend::Redis);
    let redis = store.redis().expect("a Redis");
    let backends = start_backends(&["b1", "b2", "b3"]).await;
    let members: Vec<String> = backends.iter().map(|b| url(b.local_addr())).collect();
    let gw = Config::new()
        .store(&store)
        .route(hot("api", &members))
        .start();
    let home = Config::new()
        .state(store.state().instance_index(1))
        .route(hot("api", &members).state_shards_start("home"));
    assert_eq!(home.check(), Ok(()), "the new file alone is valid");
    gw.write_config_template(&home.yaml());
    let r = gw.post_reload().await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert!(
        gw.wait_for_log(
            "take their sub-logs in turn (round_robin) until a restart",
            Duration::from_secs(10)
        )
        .await,
        "the reload says so: {}",
        gw.logs()
    );
    for _ in 0..6 {
        let r = support::request(gw.proxy_addr(), "GET", "api.test", "/", &[], b"").await;
        assert_eq!(r.status, 200, "{}", r.text());
    }
    assert_eq!(
        sub_logs_held(redis, "api"),
        [2, 2, 2],
        "each sub-log first in turn, as round_robin"
    );
}

/// On a 3-master Redis Cluster, the three sub-logs sit on three masters, each holding its
/// share, and two gateways admit exactly the limit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sub_logs_on_three_masters_admit_exactly_the_limit() {
    let cluster = RedisCluster::start();
    let backends = start_backends(&["b1", "b2", "b3"]).await;
    let members: Vec<String> = backends.iter().map(|b| url(b.local_addr())).collect();
    let config = Config::new()
        .state(State::cluster(cluster.urls()))
        .route(hot("hot", &members));
    let gateways = [config.start(), config.start()];
    admitted_exactly(&gateways, "hot.test").await;
    assert_eq!(
        backends.iter().map(|b| b.proxied_requests()).sum::<u64>(),
        LIMIT
    );
    // Each master holds one sub-log's hour log, in a slot of its own.
    let mut slots = HashSet::new();
    let mut held = Vec::new();
    for port in cluster.masters() {
        let node = &cluster.nodes()[cluster.index_of(port)];
        let keys = node.command(&["KEYS", "sluice:{hot*:q:hour:*"]).unwrap();
        let keys: Vec<&str> = keys.lines().filter(|k| !k.is_empty()).collect();
        assert_eq!(keys.len(), 1, "one sub-log on master {port}: {keys:?}");
        slots.insert(node.integer(&["CLUSTER", "KEYSLOT", keys[0]]).unwrap());
        held.push(node.log_held(keys[0]));
    }
    assert_eq!(slots.len(), 3, "three slots: {slots:?}");
    held.sort_unstable();
    assert_eq!(held, [13, 13, 14]);
}

/// `max_in_flight: 6` over three sub-logs on Redis, two gateways: six requests held at their
/// members, two each in every sub-log's leases, the seventh and eighth refused at the cap;
/// `/status` sums the sub-logs' leases; once the answers are done, every sub-log's leases are
/// gone (a release sent to another sub-log would leave them until their `lease_ttl`, 30 s).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_routes_cap_splits_over_the_sub_logs_and_each_lease_goes_back_to_its_own() {
    let store = Store::start(Backend::Redis);
    let redis = store.redis().expect("a Redis");
    let backends = start_backends(&["b1", "b2", "b3"]).await;
    let members: String = backends
        .iter()
        .map(|b| format!("      - url: \"{}\"\n", url(b.local_addr())))
        .collect();
    let base = Config::new().store(&store).yaml();
    let base = base.split("routes:").next().expect("routes come last");
    let yaml = format!(
        "{base}routes:\n  - name: cap\n    match: {{ hosts: [cap.test] }}\n    state_shards: 3\n    max_in_flight: 6\n    upstream:\n      selection: least_in_flight\n      members:\n{members}"
    );
    let gateways = [
        Gateway::start_with_ports(&yaml),
        Gateway::start_with_ports(&yaml),
    ];
    let in_flight = || backends.iter().map(|b| b.in_flight()).sum::<u64>();
    // Held 12 s: the six arrivals, the refusals and the reads below finish before the first
    // hold ends on a loaded machine (8 s left little room); longer holds outran the 30 s a
    // test request is given.
    let mut held = Vec::new();
    for i in 0..6 {
        let addr = gateways[i % 2].proxy_addr();
        held.push(tokio::spawn(async move {
            support::request(
                addr,
                "GET",
                "cap.test",
                "/",
                &[("x-delay-ms", "12000")],
                b"",
            )
            .await
            .status
        }));
        assert!(
            support::wait_until(Duration::from_secs(20), || in_flight() == i as u64 + 1).await,
            "request {i} reached its member"
        );
    }
    for gw in &gateways {
        let r = support::request(gw.proxy_addr(), "GET", "cap.test", "/", &[], b"").await;
        assert_eq!(r.status, 429, "at the cap: {}", r.text());
    }
    let lease_keys: Vec<String> = redis
        .command(&["KEYS", "sluice:{cap*:lz"])
        .unwrap()
        .lines()
        .filter(|k| !k.is_empty())
        .map(str::to_string)
        .collect();
    assert_eq!(lease_keys.len(), 3, "{lease_keys:?}");
    for k in &lease_keys {
        assert_eq!(redis.integer(&["ZCARD", k]), Some(2), "{k}: its share");
    }
    let status = gateways[0].status().await;
    let shown: u64 = status["routes"][0]["members"]
        .as_array()
        .expect("members")
        .iter()
        .map(|m| m["in_flight"].as_u64().expect("in_flight"))
        .sum();
    assert_eq!(shown, 6, "/status sums the sub-logs' leases");
    for h in held {
        assert_eq!(h.await.unwrap(), 200);
    }
    assert!(
        support::wait_until(Duration::from_secs(20), || lease_keys
            .iter()
            .all(|k| redis.integer(&["ZCARD", k]).unwrap_or(0) == 0))
        .await,
        "every lease released in its own sub-log"
    );
}
