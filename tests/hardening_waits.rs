//! The quota's waiting line (`max_wait`, `max_waiting`) under clients that misbehave or arrive
//! at the wrong moment: a waiter that hangs up, a newcomer at a full line. End to end, on the
//! memory store and on Redis.

mod support;

use std::net::SocketAddr;
use std::time::Duration;

use sluice_echo::{EchoOptions, EchoServer};
use support::{
    request, url, wait_until_async, Backend, Config, Egress, Gateway, HttpClient, Quota, Route,
};
use support::{request_head, Store};

const HOST: &str = "line.test";

/// An API that logs every request it gets, and limits nothing itself.
async fn api() -> EchoServer {
    EchoServer::start_with(
        "api",
        SocketAddr::from(([127, 0, 0, 1], 0)),
        EchoOptions::key_limited(1000, Duration::from_secs(60)),
    )
    .await
    .expect("start the API stub")
}

/// How many requests wait in route `line`'s line.
async fn waiting(gw: &Gateway) -> u64 {
    let status = gw.status().await;
    status["routes"]
        .as_array()
        .and_then(|r| r.iter().find(|r| r["name"] == "line"))
        .and_then(|r| r["waiting"].as_u64())
        .unwrap_or(0)
}

/// Waits until exactly `n` requests wait in the line.
async fn until_waiting(gw: &Gateway, n: u64) {
    let ok = wait_until_async(Duration::from_secs(20), || async { waiting(gw).await == n }).await;
    assert!(
        ok,
        "{n} request(s) wait; /status says {}",
        waiting(gw).await
    );
}

/// The targets the API received, in order.
fn served(api: &EchoServer) -> Vec<String> {
    api.request_log().into_iter().map(|l| l.target).collect()
}

/// The access lines of requests to `path`.
fn access_lines(gw: &Gateway, path: &str) -> Vec<serde_json::Value> {
    gw.log_json()
        .into_iter()
        .filter(|l| l["target"] == "sluice::access" && l["path"] == path)
        .collect()
}

on_both_stores!(
    a_waiter_that_hangs_up_leaves_the_line_uncharged,
    a_newcomer_at_a_full_line_does_not_go_ahead,
    a_tunnel_that_hangs_up_while_waiting_leaves_the_line,
);

/// One request per 8 s (time enough for the steps below on a loaded machine, and short
/// enough for the newcomer's wait of two windows to stay within the client's 30 s) and
/// `max_waiting: 2`. Two requests wait; the first one's client hangs up. It leaves the line
/// at once: a newcomer finds a place instead of a 429, the gone request is never sent to the
/// API nor charged, and the live waiter behind it is served first.
async fn a_waiter_that_hangs_up_leaves_the_line_uncharged(backend: Backend) {
    let store = Store::start(backend);
    let api = api().await;
    let route = Route::new("line")
        .hosts(&[HOST])
        .member(url(api.local_addr()))
        .quota(
            Quota::window("slow", 1, "8s")
                .max_wait("30s")
                .max_waiting(2),
        );
    let gw = Config::new().store(&store).route(route).start();
    let addr = gw.proxy_addr();
    assert_eq!(
        request(addr, "GET", HOST, "/first", &[], b"").await.status,
        200
    );

    // The waiter that will hang up: a request with its body on the way, as a POST would be.
    let mut gone = HttpClient::connect(addr).await.unwrap();
    gone.write_raw(request_head("POST", HOST, "/gone", &[], 4).as_bytes())
        .await
        .unwrap();
    gone.write_raw(b"body").await.unwrap();
    until_waiting(&gw, 1).await;
    let live = tokio::spawn(async move { request(addr, "GET", HOST, "/live", &[], b"").await });
    until_waiting(&gw, 2).await;

    drop(gone);
    until_waiting(&gw, 1).await;
    let newcomer =
        tokio::spawn(async move { request(addr, "GET", HOST, "/newcomer", &[], b"").await });
    until_waiting(&gw, 2).await;

    let live = live.await.unwrap();
    assert_eq!(live.status, 200, "{}", live.text());
    let newcomer = newcomer.await.unwrap();
    assert_eq!(newcomer.status, 200, "{}", newcomer.text());
    assert_eq!(served(&api), ["/first", "/live", "/newcomer"]);

    // The gone request's access line: no answer, no member, the client's hang-up.
    let ok = wait_until_async(Duration::from_secs(20), || async {
        !access_lines(&gw, "/gone").is_empty()
    })
    .await;
    assert!(ok, "the gone request has its access line");
    let line = &access_lines(&gw, "/gone")[0];
    assert_eq!(line["status"], 0, "{line}");
    assert_eq!(line["error"], "client_closed", "{line}");
    assert!(
        line["member"].as_str().is_none_or(str::is_empty),
        "it was never admitted (admission is where a request is charged): {line}"
    );
}

/// Quota per tenant, one request per 8 s each, `max_waiting: 1`. Tenant a's second request
/// waits and fills the line. A newcomer of tenant b, whose own window has room, is answered
/// 429 at once: a full line is full for everyone, and a newcomer never takes capacity ahead
/// of the requests already waiting. It is not charged: once the line is free, tenant b's next
/// request is admitted.
async fn a_newcomer_at_a_full_line_does_not_go_ahead(backend: Backend) {
    let store = Store::start(backend);
    let api = api().await;
    let route = Route::new("line")
        .hosts(&[HOST])
        .member(url(api.local_addr()))
        .quota(
            Quota::window("slow", 1, "8s")
                .key("header:X-Tenant")
                .max_wait("20s")
                .max_waiting(1),
        );
    let gw = Config::new().store(&store).route(route).start();
    let addr = gw.proxy_addr();
    let a = [("X-Tenant", "a")];
    let b = [("X-Tenant", "b")];
    assert_eq!(request(addr, "GET", HOST, "/a1", &a, b"").await.status, 200);
    let waiter =
        tokio::spawn(
            async move { request(addr, "GET", HOST, "/a2", &[("X-Tenant", "a")], b"").await },
        );
    until_waiting(&gw, 1).await;

    let refused = request(addr, "GET", HOST, "/b1", &b, b"").await;
    assert_eq!(refused.status, 429, "{}", refused.text());
    assert_eq!(
        refused.json()["type"],
        "urn:sluice:error:quota_exceeded",
        "{}",
        refused.text()
    );
    let retry_after: u64 = refused
        .header("retry-after")
        .expect("Retry-After")
        .parse()
        .expect("whole seconds");
    assert!((1..=8).contains(&retry_after), "Retry-After {retry_after}");
    assert!(
        !waiter.is_finished(),
        "the line was full when b1 was refused"
    );

    let waited = waiter.await.unwrap();
    assert_eq!(waited.status, 200, "{}", waited.text());
    assert_eq!(served(&api), ["/a1", "/a2"]);
    // Nothing was charged to tenant b: its window admits at once now the line is empty.
    until_waiting(&gw, 0).await;
    let b2 = request(addr, "GET", HOST, "/b2", &b, b"").await;
    assert_eq!(b2.status, 200, "{}", b2.text());
}

/// A CONNECT that waits for capacity leaves the line at once when its client hangs up, as a
/// request does: nothing is charged, and its access line says the client went away. The
/// window is long, so only the hang-up can empty the line within the test's deadline. The wait
/// allowed is twice the window: with a wait of one window, a store call slower than the gap
/// between the two tunnels made the waiter's turn end past its deadline, and it was refused at
/// once instead of waiting.
async fn a_tunnel_that_hangs_up_while_waiting_leaves_the_line(backend: Backend) {
    let store = Store::start(backend);
    let api = api().await;
    let port = api.local_addr().port();
    let route = Route::new("line")
        .hosts(&["127.0.0.1"])
        .direct_member()
        .methods(&["CONNECT"])
        .quota(Quota::window("slow", 1, "60s").max_wait("120s"));
    let gw = Config::new()
        .store(&store)
        .egress(Egress::loopback_allowed().connect_ports(&[port]))
        .route(route)
        .start();
    let connect = format!("CONNECT 127.0.0.1:{port} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n\r\n");
    let mut first = HttpClient::connect(gw.proxy_addr()).await.unwrap();
    first.write_raw(connect.as_bytes()).await.unwrap();
    assert_eq!(first.read_response(true).await.unwrap().status, 200);
    drop(first);

    let mut second = HttpClient::connect(gw.proxy_addr()).await.unwrap();
    second.write_raw(connect.as_bytes()).await.unwrap();
    until_waiting(&gw, 1).await;
    drop(second);
    until_waiting(&gw, 0).await;

    let ok = wait_until_async(Duration::from_secs(20), || async {
        gw.log_json().iter().any(|l| {
            l["target"] == "sluice::access" && l["method"] == "CONNECT" && l["status"] == 0
        })
    })
    .await;
    assert!(ok, "the gone tunnel has its access line: {}", gw.logs());
    let gone = gw
        .log_json()
        .into_iter()
        .find(|l| l["target"] == "sluice::access" && l["method"] == "CONNECT" && l["status"] == 0)
        .unwrap();
    assert_eq!(gone["error"], "client_gone", "{gone}");
}
