//! One pipeline for every request: a plain HTTP request and a CONNECT tunnel take the same
//! steps (route, admit, select, attempt, answer, account), so each behaviour here runs for both
//! kinds, on both stores, through the real binary, real forward proxies (Debian's tinyproxy)
//! as `proxy` members, and a real backend as the client's target.

mod support;

use std::net::SocketAddr;
use std::time::Duration;

use serde_json::Value;
use support::tinyproxy::Tinyproxy;
use support::{
    start_backends, Backend, Config, Egress, Gateway, HttpClient, Quota, Route, Store, TempDir,
};

const WAIT: Duration = Duration::from_secs(20);

/// How a request reaches its target through sluice.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    /// `GET http://target/x` in absolute form.
    Request,
    /// `CONNECT target`, then the same GET inside the tunnel.
    Tunnel,
}

const KINDS: [Kind; 2] = [Kind::Request, Kind::Tunnel];

/// What the client saw of one exchange through sluice.
struct Seen {
    /// sluice's answer to the request, or to the CONNECT.
    status: u16,
    retry_after: Option<String>,
    code: Option<String>,
    /// The target's answer, inside a tunnel or through the proxy.
    upstream: Option<String>,
}

/// One exchange of `kind` through `gw` to `target`.
async fn exchange(gw: &Gateway, kind: Kind, target: SocketAddr) -> Seen {
    let header = |r: &support::Response, name: &str| r.header(name).map(str::to_string);
    match kind {
        Kind::Request => {
            let mut client = HttpClient::connect(gw.proxy_addr()).await.unwrap();
            let r = client
                .send(
                    &format!("GET http://{target}/x HTTP/1.1\r\nHost: {target}\r\n\r\n"),
                    b"",
                )
                .await
                .unwrap();
            Seen {
                status: r.status,
                retry_after: header(&r, "retry-after"),
                code: header(&r, "x-sluice-error"),
                upstream: header(&r, "x-upstream"),
            }
        }
        Kind::Tunnel => {
            let (mut client, head) =
                support::open_tunnel(gw.proxy_addr(), &target.to_string(), true).await;
            let mut seen = Seen {
                status: head.status,
                retry_after: header(&head, "retry-after"),
                code: header(&head, "x-sluice-error"),
                upstream: None,
            };
            if head.status == 200 {
                let r = client
                    .request("GET", &target.to_string(), "/x", &[], b"")
                    .await
                    .unwrap();
                seen.upstream = header(&r, "x-upstream");
            }
            seen
        }
    }
}

/// The access lines of `gw` so far.
fn access_lines(gw: &Gateway) -> Vec<Value> {
    gw.log_json()
        .into_iter()
        .filter(|l| l["target"] == "sluice::access")
        .collect()
}

/// Gateways on `store` for `config`: two sharing Redis, one on memory.
fn gateways(store: &Store, config: Config) -> Vec<Gateway> {
    let config = config.store(store);
    (0..store.instances()).map(|_| config.start()).collect()
}

/// Admission and selection: the route's quota is charged once per request or tunnel, a
/// refusal is a 429 with `Retry-After` on the request or the CONNECT itself, and least-used
/// spreads the admitted ones exactly over the proxies, across every instance.
async fn admission_and_selection(backend: Backend) {
    let backends = start_backends(&["target"]).await;
    let target = backends[0].local_addr();
    let dir = TempDir::new("pipeline-admit");
    let proxies = [
        Tinyproxy::start(dir.path(), "p1", None),
        Tinyproxy::start(dir.path(), "p2", None),
    ];
    for kind in KINDS {
        let store = Store::start(backend);
        let gws = gateways(
            &store,
            Config::new()
                .egress(Egress::loopback_allowed().connect_ports(&[target.port()]))
                .route(
                    Route::new("api")
                        .hosts(&["127.0.0.1"])
                        .least_used()
                        .proxy_member(proxies[0].url())
                        .proxy_member(proxies[1].url())
                        .quota(Quota::window("hour", 4, "1h")),
                ),
        );
        for i in 0..4 {
            let seen = exchange(&gws[i % gws.len()], kind, target).await;
            assert_eq!(seen.status, 200, "{kind:?} {i}: {:?}", seen.code);
            assert_eq!(seen.upstream.as_deref(), Some("target"), "{kind:?}");
        }
        let refused = exchange(&gws[0], kind, target).await;
        assert_eq!(refused.status, 429, "{kind:?}");
        assert_eq!(refused.code.as_deref(), Some("quota_exceeded"), "{kind:?}");
        assert!(
            refused
                .retry_after
                .is_some_and(|s| s.parse::<u64>().unwrap() >= 1),
            "{kind:?}"
        );
        // Two assignments each: the refused one was neither charged nor assigned.
        let status = gws[0].status().await;
        let counts: Vec<u64> = status["routes"][0]["members"]
            .as_array()
            .unwrap()
            .iter()
            .map(|m| m["assignments"].as_u64().unwrap())
            .collect();
        assert_eq!(counts, [2, 2], "{kind:?}: {status}");
        assert_eq!(status["routes"][0]["quota"][0]["remaining"], 0, "{kind:?}");
    }
}

/// Retry and accounting: a connect failure on the first member is retried on the next, for
/// every method and for tunnels, since nothing was sent; the access line says which members
/// were tried, and which one served.
async fn retry_and_accounting(backend: Backend) {
    let backends = start_backends(&["target"]).await;
    let target = backends[0].local_addr();
    let dir = TempDir::new("pipeline-retry");
    let live = Tinyproxy::start(dir.path(), "live", None);
    // A port nothing listens on: the connection is refused.
    let dead = support::dead_url();
    for kind in KINDS {
        let store = Store::start(backend);
        let gw = Config::new()
            .store(&store)
            .egress(Egress::loopback_allowed().connect_ports(&[target.port()]))
            .route(
                Route::new("api")
                    .hosts(&["127.0.0.1"])
                    .priority()
                    .retries(1)
                    .proxy_member(dead.clone())
                    .proxy_member(live.url()),
            )
            .start();
        let seen = exchange(&gw, kind, target).await;
        assert_eq!(seen.status, 200, "{kind:?}: {:?}\n{}", seen.code, gw.logs());
        assert_eq!(seen.upstream.as_deref(), Some("target"), "{kind:?}");
        assert!(support::wait_until(WAIT, || !access_lines(&gw).is_empty()).await);
        let line = access_lines(&gw).pop().unwrap();
        assert_eq!(line["route"], "api", "{kind:?}: {line}");
        assert_eq!(line["status"], 200, "{kind:?}: {line}");
        assert_eq!(line["attempts"], 2, "{kind:?}: {line}");
        assert_eq!(
            line["members_tried"],
            serde_json::json!([dead, live.url()]),
            "{kind:?}: {line}"
        );
        assert_eq!(line["member"], live.url(), "{kind:?}: {line}");
        let method = if kind == Kind::Tunnel {
            "CONNECT"
        } else {
            "GET"
        };
        assert_eq!(line["method"], method, "{kind:?}: {line}");
    }
}

/// The answers sluice makes itself are the same for both kinds: problem+json with its code,
/// naming the route, and an access line with that code.
async fn answers_and_their_lines(backend: Backend) {
    let backends = start_backends(&["target"]).await;
    let target = backends[0].local_addr();
    for kind in KINDS {
        let store = Store::start(backend);
        // A route whose only member is down for good: no eligible member.
        let gw = Config::new()
            .store(&store)
            .egress(Egress::loopback_allowed().connect_ports(&[target.port()]))
            .route(Route::new("api").hosts(&["127.0.0.1"]))
            .start();
        let seen = exchange(&gw, kind, target).await;
        assert_eq!(seen.status, 503, "{kind:?}");
        assert_eq!(seen.code.as_deref(), Some("no_member"), "{kind:?}");
        assert!(support::wait_until(WAIT, || !access_lines(&gw).is_empty()).await);
        let line = access_lines(&gw).pop().unwrap();
        assert_eq!(line["error"], "no_member", "{kind:?}: {line}");
        assert_eq!(line["route"], "api", "{kind:?}: {line}");
        assert_eq!(line["attempts"], 0, "{kind:?}: {line}");
    }
}

on_both_stores!(
    admission_and_selection,
    retry_and_accounting,
    answers_and_their_lines
);
