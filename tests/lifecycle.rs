//! Health over time and process life: a backend dies under load, comes back, a passively
//! ejected member gets its trial, and SIGTERM/SIGINT let requests in flight finish.

mod support;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use sluice_echo::EchoServer;
use support::{
    free_port, request, start_backends, url, Config, Gateway, HealthCheck, HttpClient, Passive,
    Route,
};

/// A gateway (two proxy threads) with one route `api` on host `api.test` over `members`,
/// with two retries, and whatever `more` adds.
fn start(members: &[String], more: impl FnOnce(Route) -> Route) -> Gateway {
    Config::new()
        .threads(2)
        .route(more(Route::new("api").retries(2).members(members)))
        .start()
}

fn active_check() -> HealthCheck {
    HealthCheck::fast_http("100ms", 2, 2)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backend_killed_under_load_fails_no_request_and_comes_back() {
    let backends = start_backends(&["b1", "b2", "b3"]).await;
    let members: Vec<String> = backends.iter().map(|b| url(b.local_addr())).collect();
    let gw = start(&members, |r| r.health_check(active_check()));
    let victim_addr = backends[1].local_addr();
    let victim = members[1].clone();

    // 4 clients on keep-alive connections, GET and POST alternating, 150 requests each.
    let sent = Arc::new(AtomicU64::new(0));
    let mut clients = Vec::new();
    for c in 0..4 {
        let (addr, sent) = (gw.proxy_addr(), sent.clone());
        clients.push(tokio::spawn(async move {
            let mut client = HttpClient::connect(addr).await.unwrap();
            let mut failures = Vec::new();
            for i in 0..150 {
                let method = if (i + c) % 2 == 0 { "GET" } else { "POST" };
                match client
                    .request(method, "api.test", "/load", &[], b"body")
                    .await
                {
                    Ok(r) if r.status == 200 => {}
                    Ok(r) => failures.push(format!("{method}: {} {}", r.status, r.text())),
                    Err(e) => failures.push(format!("{method}: {e}")),
                }
                sent.fetch_add(1, Ordering::Relaxed);
            }
            failures
        }));
    }
    // Kill b2 once the load is well under way.
    assert!(
        support::wait_until(Duration::from_secs(30), || sent.load(Ordering::Relaxed)
            >= 150)
        .await
    );
    backends[1].stop().await;
    let mut failures = Vec::new();
    for c in clients {
        failures.extend(c.await.unwrap());
    }
    assert!(
        failures.is_empty(),
        "{} failed: {:?}",
        failures.len(),
        &failures[..failures.len().min(5)]
    );

    let ejected = support::wait_until_async(Duration::from_secs(20), || async {
        gw.metric("sluice_member_healthy", &[("member", &victim)])
            .await
            == Some(0.0)
    })
    .await;
    assert!(ejected, "the killed member must be marked down");

    // Bring b2 back on the same address: the active check must restore it.
    let revived = EchoServer::start("b2-again", victim_addr).await.unwrap();
    let restored = support::wait_until_async(Duration::from_secs(20), || async {
        gw.metric("sluice_member_healthy", &[("member", &victim)])
            .await
            == Some(1.0)
    })
    .await;
    assert!(restored, "active checks must bring the member back");
    // The stopped b2 still answers on connections it had open (EchoServer::stop leaves idle
    // ones be, as a graceful deploy does), and sluice may hold one in its pool: a request to
    // the member's address can reach either process, so both are counted.
    let old_before = backends[1].proxied_requests();
    let mut client = HttpClient::connect(gw.proxy_addr()).await.unwrap();
    for _ in 0..30 {
        assert_eq!(
            client
                .request("GET", "api.test", "/", &[], b"")
                .await
                .unwrap()
                .status,
            200
        );
    }
    assert_eq!(
        revived.proxied_requests() + (backends[1].proxied_requests() - old_before),
        10,
        "the revived member takes its third of the traffic"
    );
    assert!(gw.logs().contains("member down") && gw.logs().contains("member up"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_active_checks_a_down_member_gets_one_trial_after_cooldown() {
    let backends = start_backends(&["steady"]).await;
    let port = free_port();
    let late: SocketAddr = ([127, 0, 0, 1], port).into();
    let members = [url(late), url(backends[0].local_addr())];
    let gw = start(&members, |r| r.passive(Passive::cooldown("1s").fall(1)));
    // The first request tries the absent member, fails to connect, and is retried. The member
    // is ejected during it, so its cooldown ends no earlier than 1 s after `first_sent`.
    let first_sent = Instant::now();
    let r = request(gw.proxy_addr(), "GET", "api.test", "/", &[], b"").await;
    assert_eq!(r.status, 200);
    assert_eq!(
        gw.metric("sluice_member_healthy", &[("member", &members[0])])
            .await,
        Some(0.0)
    );

    let comeback = EchoServer::start("late", late).await.unwrap();
    // Send requests until one reaches the revived member: that one is the trial. Every request
    // before it must have gone to `steady`, and the trial cannot come before the cooldown is
    // over. Neither check depends on how fast the machine is: a delay only moves `answered`
    // later.
    let cooldown_over_at_the_earliest = first_sent + Duration::from_secs(1);
    let deadline = first_sent + Duration::from_secs(15);
    let mut within_cooldown = 0;
    loop {
        let r = request(gw.proxy_addr(), "GET", "api.test", "/", &[], b"").await;
        let answered = Instant::now();
        assert_eq!(r.status, 200, "{}", r.text());
        if r.json()["upstream"] == "late" {
            assert!(
                answered >= cooldown_over_at_the_earliest,
                "a trial request before the cooldown was over"
            );
            break;
        }
        assert_eq!(r.json()["upstream"], "steady");
        if answered < cooldown_over_at_the_earliest {
            within_cooldown += 1;
        }
        assert!(
            Instant::now() < deadline,
            "no trial request within 15 s of a 1 s cooldown"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    println!("{within_cooldown} requests went to steady during the cooldown");
    assert_eq!(comeback.proxied_requests(), 1, "one trial request");
    // The trial succeeded and restored the member.
    assert_eq!(
        gw.metric("sluice_member_healthy", &[("member", &members[0])])
            .await,
        Some(1.0)
    );
    for _ in 0..10 {
        request(gw.proxy_addr(), "GET", "api.test", "/", &[], b"").await;
    }
    assert_eq!(
        comeback.proxied_requests(),
        6,
        "back in the rotation: the trial plus half of ten"
    );
}

async fn in_flight_requests_finish_on(signal: &str) {
    let backends = start_backends(&["slow"]).await;
    let mut gw = start(&[url(backends[0].local_addr())], |r| r);
    let mut requests = Vec::new();
    for _ in 0..6 {
        let addr = gw.proxy_addr();
        requests.push(tokio::spawn(async move {
            support::try_request(
                addr,
                "POST",
                "api.test",
                "/slow",
                &[("x-delay-ms", "1000")],
                b"x",
            )
            .await
        }));
    }
    // Let all six reach the backend, then ask the gateway to stop.
    assert!(support::wait_until(Duration::from_secs(20), || backends[0].requests() == 6).await);
    gw.signal(signal);
    for r in requests {
        let r = r.await.unwrap().expect("the request in flight is answered");
        assert_eq!(r.status, 200, "{}", r.text());
    }
    let status = gw
        .wait_exit_async(Duration::from_secs(30))
        .await
        .expect("sluice exits");
    assert_eq!(status.code(), Some(0), "{}", gw.logs());
    assert!(gw.logs().contains("sluice stopped"));
    assert!(
        support::try_request(gw.proxy_addr(), "GET", "api.test", "/", &[], b"")
            .await
            .is_err(),
        "nothing listens after the stop"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_lets_requests_in_flight_finish_and_exits_0() {
    in_flight_requests_finish_on("TERM").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigint_is_as_graceful_as_sigterm() {
    in_flight_requests_finish_on("INT").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn access_log_has_one_json_line_per_request() {
    let backends = start_backends(&["b1"]).await;
    let gw = start(&[url(backends[0].local_addr())], |r| r);
    request(
        gw.proxy_addr(),
        "POST",
        "api.test",
        "/logged?x=1",
        &[],
        b"x",
    )
    .await;
    request(gw.proxy_addr(), "GET", "nope.test", "/missing", &[], b"").await;
    let found = support::wait_until(Duration::from_secs(20), || {
        gw.log_json()
            .iter()
            .filter(|l| l["target"] == "sluice::access")
            .count()
            == 2
    })
    .await;
    assert!(found, "{}", gw.logs());
    let lines: Vec<serde_json::Value> = gw
        .log_json()
        .into_iter()
        .filter(|l| l["target"] == "sluice::access")
        .collect();
    // Each request had its own connection, so their lines may come in either order.
    let ok = lines
        .iter()
        .find(|l| l["path"] == "/logged")
        .unwrap_or_else(|| panic!("no line for /logged:\n{}", gw.logs()));
    let missing = lines
        .iter()
        .find(|l| l["path"] == "/missing")
        .unwrap_or_else(|| panic!("no line for /missing:\n{}", gw.logs()));
    assert_eq!(ok["route"], "api");
    assert_eq!(ok["method"], "POST");
    assert_eq!(ok["authority"], "api.test");
    assert_eq!(ok["path"], "/logged");
    assert_eq!(ok["status"], 200);
    assert_eq!(ok["member"], url(backends[0].local_addr()));
    assert_eq!(ok["attempts"], 1);
    assert!(ok["duration_ms"].as_f64().is_some());
    assert_eq!(missing["status"], 404);
    assert_eq!(missing["route"], "_none");
}

/// A request still in flight when the drain period ends is cut, and the exit status says so:
/// 3, not the 0 of a stop in which every request finished (SPEC §1).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drain_that_cuts_requests_exits_3() {
    let backends = start_backends(&["slow"]).await;
    let mut gw = Config::new()
        .route(Route::new("api").members([url(backends[0].local_addr())]))
        .start_with_env(&[("SLUICE_DRAIN_PERIOD", "500ms")]);
    let addr = gw.proxy_addr();
    let slow = tokio::spawn(async move {
        support::try_request(
            addr,
            "GET",
            "api.test",
            "/slow",
            &[("x-delay-ms", "30000")],
            b"",
        )
        .await
    });
    assert!(support::wait_until(Duration::from_secs(20), || backends[0].requests() == 1).await);
    gw.sigterm();
    let status = gw
        .wait_exit_async(Duration::from_secs(30))
        .await
        .expect("sluice exits once the drain period is over");
    assert_eq!(status.code(), Some(3), "{}", gw.logs());
    assert!(
        slow.await.unwrap().is_err(),
        "the slow request was cut, not answered"
    );
    assert!(gw.logs().contains("requests in flight, which are cut"));
}
