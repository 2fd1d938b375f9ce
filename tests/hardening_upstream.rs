//! Failures on the way to a member, and how the client, the access log and the gateway's own
//! log tell them: the right code for each, and the reason for each attempt.

mod support;

use std::net::SocketAddr;
use std::time::Duration;

use support::{request, url, Config, Gateway, Route};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

const HOST: &str = "api.test";
const DEADLINE: Duration = Duration::from_secs(20);

/// A member that reads each request and answers `answer` (nothing at all when empty), then
/// holds the connection open.
async fn member_answering(answer: &'static [u8]) -> SocketAddr {
    let member = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = member.local_addr().unwrap();
    tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((mut conn, _)) = member.accept().await {
            let mut head = [0u8; 4096];
            let _ = conn.read(&mut head).await;
            if !answer.is_empty() {
                let _ = conn.write_all(answer).await;
            }
            held.push(conn);
        }
    });
    addr
}

/// The access line of the request to `path`, once it is written.
async fn access_line(gw: &Gateway, path: &str) -> serde_json::Value {
    let needle = format!("\"path\":\"{path}\"");
    assert!(gw.wait_for_log(&needle, DEADLINE).await, "{path} is logged");
    gw.log_json()
        .into_iter()
        .find(|l| l["target"] == "sluice::access" && l["path"] == path)
        .unwrap_or_else(|| panic!("the access line of {path}"))
}

/// A member that never answers: the client gets `504 upstream_timeout`, and the access log
/// says the same, not that a response was cut short (the 504 is the gateway's own head).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_read_timeout_is_logged_as_upstream_timeout() {
    let member = member_answering(b"").await;
    let gw = Config::new()
        .route(Route::new("api").member(url(member)).read_timeout("500ms"))
        .start();
    let r = request(gw.proxy_addr(), "GET", HOST, "/silent", &[], b"").await;
    assert_eq!(r.status, 504, "{}", r.text());
    assert_eq!(r.header("x-sluice-error"), Some("upstream_timeout"));
    let line = access_line(&gw, "/silent").await;
    assert_eq!(line["status"], 504, "{line}");
    assert_eq!(line["error"], "upstream_timeout", "{line}");
}

/// A member that answers with bytes that are not HTTP: the client gets `502`, and the access
/// log says the answer could not be read, not that it was cut short.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_answer_that_is_not_http_is_logged_as_upstream_bad_response() {
    let member = member_answering(b"this is not HTTP at all\r\n\r\n").await;
    let gw = Config::new()
        .route(Route::new("api").member(url(member)))
        .start();
    let r = request(gw.proxy_addr(), "GET", HOST, "/garbage", &[], b"").await;
    assert_eq!(r.status, 502, "{}", r.text());
    let line = access_line(&gw, "/garbage").await;
    assert_eq!(line["status"], 502, "{line}");
    assert_eq!(line["error"], "upstream_bad_response", "{line}");
}
