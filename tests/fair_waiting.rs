//! Fair waiting end to end, through the real binary: the waiters of a route are served in turn
//! across clients (the identified client's name) or, on a route without clients, across
//! `quota.key` values, so that one client's burst cannot starve another.
//!
//! The order is made exact, not timed: a route with `max_in_flight: 1` admits one request at a
//! time, and its member holds the first answer until every request of the test waits in the
//! line (as `/status` counts them). Then the member answers everything, and the order in
//! which it saw the requests is the order the line admitted them.

mod support;

use std::net::SocketAddr;
use std::time::Duration;

use sluice_echo::openai::OpenAiStub;
use support::{request, url, wait_until, wait_until_async, Backend, Config, Gateway, Store};

on_both_stores!(
    a_teams_burst_does_not_starve_another_team,
    a_clients_burst_does_not_starve_another_client,
    a_full_line_makes_room_for_another_team,
);

/// Requests of the client that sends a burst, besides the first one, which the member holds.
const BURST: usize = 24;
/// Requests of the client that sends a few.
const FEW: usize = 3;

const ALPHA_TOKEN: &str = "alpha-token-0123456789";
const BETA_TOKEN: &str = "beta-token-0123456789";

/// The config of `store` with one route, `fair.test`, to `member`: one request at a time, and
/// waiting up to a minute for it; `quota` is the rest of its quota.
fn config(store: &Store, member: &str, quota: &str) -> String {
    let base = Config::new().store(store).yaml();
    let base = base
        .split("routes:")
        .next()
        .expect("the builder writes routes last")
        .to_string();
    format!(
        "{base}routes:
  - name: fair
    match: {{ hosts: [fair.test] }}
    max_in_flight: 1
    quota: {{ max_wait: 60s{quota} }}
    upstream:
      members:
        - {{ name: m1, url: \"{member}\" }}
"
    )
}

/// How many requests wait in the route's line.
async fn waiting(gw: &Gateway) -> u64 {
    let status = gw.status().await;
    status["routes"]
        .as_array()
        .expect("routes")
        .iter()
        .find(|r| r["name"] == "fair")
        .expect("the route is in /status")["waiting"]
        .as_u64()
        .expect("waiting is a number")
}

/// Sends one request tagged `who` (in `x-who`, which the member records) with `headers`.
fn send(
    addr: SocketAddr,
    who: String,
    headers: Vec<(&'static str, String)>,
) -> tokio::task::JoinHandle<u16> {
    tokio::spawn(async move {
        let mut all: Vec<(&str, &str)> = headers.iter().map(|(n, v)| (*n, v.as_str())).collect();
        all.push(("x-who", &who));
        request(addr, "GET", "fair.test", "/v1/models", &all, b"")
            .await
            .status
    })
}

/// Client `a` sends one request, which the member holds, then a burst of [`BURST`] that wait;
/// then client `b` sends [`FEW`], which wait too. Once all of them wait, the member answers
/// everything. Each of b's requests must be admitted after at most one more of a's than the
/// one before it: b's first after the held one, the one that held the turn when b came and
/// a's turn in the round before b's; every later one after one more turn of a's. A first-in,
/// first-out line admits all of a's burst first.
async fn burst_against(
    gw: &Gateway,
    stub: &OpenAiStub,
    a: Vec<(&'static str, String)>,
    b: Vec<(&'static str, String)>,
) {
    let addr = gw.proxy_addr();
    stub.hold();
    let mut sent = vec![send(addr, "a0".into(), a.clone())];
    assert!(
        wait_until(Duration::from_secs(20), || stub.held() == 1).await,
        "the first request reaches the member"
    );
    for i in 1..=BURST {
        sent.push(send(addr, format!("a{i}"), a.clone()));
    }
    assert!(
        wait_until_async(Duration::from_secs(20), || async {
            waiting(gw).await == BURST as u64
        })
        .await,
        "a's burst waits"
    );
    for i in 1..=FEW {
        sent.push(send(addr, format!("b{i}"), b.clone()));
    }
    assert!(
        wait_until_async(Duration::from_secs(20), || async {
            waiting(gw).await == (BURST + FEW) as u64
        })
        .await,
        "b's requests wait too"
    );
    stub.release();
    for s in sent {
        assert_eq!(s.await.unwrap(), 200);
    }
    let order: Vec<String> = stub
        .exchanges()
        .iter()
        .map(|e| e.header("x-who").unwrap_or("?").to_string())
        .collect();
    assert_eq!(order.len(), 1 + BURST + FEW, "{order:?}");
    assert_eq!(order[0], "a0", "the held request was first: {order:?}");
    let mut a_before = 0;
    let mut bs = 0;
    for who in &order {
        if who.starts_with('a') {
            a_before += 1;
            continue;
        }
        assert!(
            a_before <= 3 + bs,
            "b's request number {} was admitted after {a_before} of a's: {order:?}",
            bs + 1
        );
        bs += 1;
    }
    assert_eq!(bs, FEW);
}

/// On a route without clients, the waiters take turns by `quota.key` (here a team header).
async fn a_teams_burst_does_not_starve_another_team(backend: Backend) {
    let store = Store::start(backend);
    let stub = OpenAiStub::start("stub", "127.0.0.1:0".parse().unwrap())
        .await
        .unwrap();
    let yaml = config(&store, &url(stub.local_addr()), ", key: \"header:x-team\"");
    let gw = Gateway::start_with_ports(&yaml);
    burst_against(
        &gw,
        &stub,
        vec![("x-team", "alpha".into())],
        vec![("x-team", "beta".into())],
    )
    .await;
}

/// With clients, the waiters take turns by the identified client, whatever the quota's key
/// (here one key for the whole route).
async fn a_clients_burst_does_not_starve_another_client(backend: Backend) {
    let store = Store::start(backend);
    let stub = OpenAiStub::start("stub", "127.0.0.1:0".parse().unwrap())
        .await
        .unwrap();
    let yaml = format!(
        "{}clients:
  list:
    - name: alpha
      tokens: [\"{ALPHA_TOKEN}\"]
      routes: [\"*\"]
      destinations: [\"*\"]
    - name: beta
      tokens: [\"{BETA_TOKEN}\"]
      routes: [\"*\"]
      destinations: [\"*\"]
",
        config(&store, &url(stub.local_addr()), "")
    );
    let gw = Gateway::start_with_ports(&yaml);
    let auth = |token: &str| vec![("Proxy-Authorization", format!("Bearer {token}"))];
    burst_against(&gw, &stub, auth(ALPHA_TOKEN), auth(BETA_TOKEN)).await;
}

/// A burst that fills the line (`max_waiting`) does not keep another team out of it: each of
/// the other team's requests pushes out the newest of the burst, which is answered 429 as at a
/// full line, and is admitted in its turn. A line that refused newcomers once full would
/// answer all of the other team's requests 429.
async fn a_full_line_makes_room_for_another_team(backend: Backend) {
    const MAX_WAITING: usize = 10;
    let store = Store::start(backend);
    let stub = OpenAiStub::start("stub", "127.0.0.1:0".parse().unwrap())
        .await
        .unwrap();
    let quota = format!(", key: \"header:x-team\", max_waiting: {MAX_WAITING}");
    let gw = Gateway::start_with_ports(&config(&store, &url(stub.local_addr()), &quota));
    let addr = gw.proxy_addr();
    let alpha = || vec![("x-team", "alpha".to_string())];
    stub.hold();
    let plug = send(addr, "a0".into(), alpha());
    assert!(
        wait_until(Duration::from_secs(20), || stub.held() == 1).await,
        "the first request reaches the member"
    );
    let burst: Vec<_> = (1..=MAX_WAITING)
        .map(|i| send(addr, format!("a{i}"), alpha()))
        .collect();
    assert!(
        wait_until_async(Duration::from_secs(20), || async {
            waiting(&gw).await == MAX_WAITING as u64
        })
        .await,
        "the burst fills the line"
    );
    let few: Vec<_> = (1..=FEW)
        .map(|i| send(addr, format!("b{i}"), vec![("x-team", "beta".to_string())]))
        .collect();
    assert!(
        wait_until(Duration::from_secs(20), || {
            burst.iter().filter(|t| t.is_finished()).count() >= FEW
        })
        .await,
        "as many of the burst are answered as beta sent"
    );
    stub.release();
    assert_eq!(plug.await.unwrap(), 200);
    for b in few {
        assert_eq!(b.await.unwrap(), 200, "beta got into the full line");
    }
    let mut statuses = Vec::new();
    for a in burst {
        statuses.push(a.await.unwrap());
    }
    let refused = statuses.iter().filter(|&&s| s == 429).count();
    assert_eq!(refused, FEW, "{statuses:?}");
    assert_eq!(
        statuses.iter().filter(|&&s| s == 200).count(),
        MAX_WAITING - FEW
    );
}
