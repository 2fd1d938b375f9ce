//! Selection policies end to end, on both state stores: `priority` (first healthy member in
//! list order, backups behind it, with the same retries, health and quota as the others), and
//! the single trial of a down member surviving a quota refusal.

mod support;

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use sluice_echo::EchoServer;
use sluice_testkit::RedisServer;
use support::{free_port, request, start_backends, wait_until_async, Gateway};

fn url(addr: SocketAddr) -> String {
    format!("http://{addr}")
}

/// `state` section for a store: memory (none) or the given Redis.
fn state(redis: Option<&RedisServer>) -> String {
    match redis {
        None => String::new(),
        // The tests' generous call timeout: a slower call on a loaded machine must not become
        // a store error, which `on_store_error: open` admits uncounted.
        Some(r) => format!(
            "state:\n  backend: redis\n  redis:\n    url: \"{}\"\n    timeout: {}\n",
            r.url(),
            support::config::REDIS_TIMEOUT
        ),
    }
}

fn config(state: &str, selection: &str, members: &[String], upstream: &str, route: &str) -> String {
    let mut yaml = format!(
        "listen: [\"{{PROXY}}\"]\nadmin:\n  listen: \"{{ADMIN}}\"\nthreads: 1\n{state}routes:\n  - name: api\n    match:\n      hosts: [\"api.test\"]\n    upstream:\n      selection: {selection}\n      retries: 2\n      members:\n"
    );
    for m in members {
        yaml.push_str(&format!("        - url: \"{m}\"\n"));
    }
    yaml.push_str(upstream);
    yaml.push_str(route);
    yaml
}

async fn get(gw: &Gateway) -> support::Response {
    request(gw.proxy_addr(), "GET", "api.test", "/", &[], b"").await
}

/// Priority: every request goes to the first member while it is up; when it dies, its backup
/// takes over with no failed request; when it comes back (active checks), traffic returns.
async fn priority_prefers_the_first_healthy_member(redis: Option<&RedisServer>) {
    let backends = start_backends(&["primary", "backup", "last"]).await;
    let members: Vec<String> = backends.iter().map(|b| url(b.local_addr())).collect();
    // The check's timeout is long: the primary fails its checks with a 503 at once, and with
    // `fall: 1` one check a loaded machine delayed past a short timeout would take the healthy
    // primary out.
    let gw = Gateway::start_with_ports(&config(
        &state(redis),
        "priority",
        &members,
        "      health_check:\n        kind: http\n        path: /healthz\n        interval: 100ms\n        timeout: 5s\n        rise: 1\n        fall: 1\n",
        "",
    ));
    for _ in 0..10 {
        let r = get(&gw).await;
        assert_eq!(
            (r.status, r.json()["upstream"].clone()),
            (200, "primary".into())
        );
    }
    assert_eq!(
        backends[1].proxied_requests() + backends[2].proxied_requests(),
        0
    );

    // The primary stops answering its checks: the backup takes every request.
    backends[0].set_healthy(false);
    assert!(
        wait_until_async(Duration::from_secs(20), || async {
            gw.metric("sluice_member_healthy", &[("member", &members[0])])
                .await
                == Some(0.0)
        })
        .await
    );
    for _ in 0..10 {
        let r = get(&gw).await;
        assert_eq!(
            (r.status, r.json()["upstream"].clone()),
            (200, "backup".into())
        );
    }
    assert_eq!(
        backends[2].proxied_requests(),
        0,
        "the last member is a backup's backup"
    );

    // Back up: traffic returns to the primary.
    backends[0].set_healthy(true);
    assert!(
        wait_until_async(Duration::from_secs(20), || async {
            gw.metric("sluice_member_healthy", &[("member", &members[0])])
                .await
                == Some(1.0)
        })
        .await
    );
    let r = get(&gw).await;
    assert_eq!(r.json()["upstream"], "primary");
    assert_eq!(gw.status().await["routes"][0]["selection"], "priority");
}

/// Priority with a dead first member (nothing listens): the connect failure is retried on the
/// next member in order, for every request, and the quota is charged once per request.
async fn priority_retries_in_list_order_and_charges_once(redis: Option<&RedisServer>) {
    let backends = start_backends(&["second", "third"]).await;
    let dead = support::dead_url();
    let members = vec![
        dead,
        url(backends[0].local_addr()),
        url(backends[1].local_addr()),
    ];
    let gw = Gateway::start_with_ports(&config(
        &state(redis),
        "priority",
        &members,
        "      passive:\n        fall: 1\n        cooldown: 1h\n",
        "    quota:\n      windows:\n        - { name: w, limit: 5, window: 1h }\n",
    ));
    for i in 0..5 {
        let r = get(&gw).await;
        assert_eq!(
            (r.status, r.json()["upstream"].clone()),
            (200, "second".into()),
            "request {i}"
        );
    }
    // The sixth is refused by the quota: five were charged, retries included, and nothing
    // reaches a member.
    let r = get(&gw).await;
    assert_eq!(r.status, 429);
    assert_eq!(r.header("x-sluice-error"), Some("quota_exceeded"));
    assert_eq!(backends[0].proxied_requests(), 5);
    assert_eq!(backends[1].proxied_requests(), 0);
}

/// A passive-only pool, a member down, and a quota that refuses the requests that come when
/// the member's trial is due. Each refused request must give the trial back; once the quota
/// has room again, the trial goes out, succeeds, and the member is back. (Admission once
/// claimed the trial before the quota's verdict and never released it on a 429: the member
/// stayed in its trial forever, even across reloads.)
async fn a_quota_refusal_gives_a_down_members_trial_back(redis: Option<&RedisServer>) {
    let backends = start_backends(&["steady"]).await;
    let late: SocketAddr = ([127, 0, 0, 1], free_port()).into();
    let members = vec![url(late), url(backends[0].local_addr())];
    // The window outlasts the refused requests below (2.5 s) by far: a request sent just
    // before 2.5 s that a loaded machine delays must still find the window full.
    let window = Duration::from_secs(8);
    let gw = Gateway::start_with_ports(&config(
        &state(redis),
        "least_used",
        &members,
        "      passive:\n        fall: 1\n        cooldown: 1s\n",
        "    quota:\n      windows:\n        - { name: w, limit: 3, window: 8s }\n",
    ));
    let started = Instant::now();
    // Least-used tries every member within the first two requests, so `late` is found down.
    for _ in 0..3 {
        assert_eq!(get(&gw).await.status, 200);
    }
    assert_eq!(
        gw.metric("sluice_member_healthy", &[("member", &members[0])])
            .await,
        Some(0.0)
    );
    // The quota is spent. Refused requests keep arriving through the moment the trial falls
    // due (the cooldown is 1 s), until well past it.
    let mut refused = 0;
    while started.elapsed() < Duration::from_millis(2500) {
        let r = get(&gw).await;
        assert_eq!(r.status, 429, "the window still holds three requests");
        refused += 1;
    }
    assert!(refused > 0);
    let comeback = EchoServer::start("late", late).await.unwrap();
    // Once the window has room, the trial goes to `late` and restores it.
    let deadline = started + window + Duration::from_secs(15);
    while comeback.proxied_requests() == 0 && Instant::now() < deadline {
        let r = get(&gw).await;
        assert!(r.status == 200 || r.status == 429, "status {}", r.status);
        if r.status == 429 {
            let ms = r.json()["retry_after_ms"].as_u64().unwrap_or(100);
            tokio::time::sleep(Duration::from_millis(ms.clamp(10, 1000))).await;
        }
    }
    assert!(
        comeback.proxied_requests() > 0,
        "the down member never got its trial: a refused request kept it"
    );
    assert_eq!(
        gw.metric("sluice_member_healthy", &[("member", &members[0])])
            .await,
        Some(1.0)
    );
}

macro_rules! on_both_stores {
    ($($name:ident),* $(,)?) => {
        mod memory {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    super::$name(None).await;
                }
            )*
        }
        mod redis {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    let redis = sluice_testkit::RedisServer::start();
                    super::$name(Some(&redis)).await;
                }
            )*
        }
    };
}

on_both_stores!(
    priority_prefers_the_first_healthy_member,
    priority_retries_in_list_order_and_charges_once,
    a_quota_refusal_gives_a_down_members_trial_back,
);
