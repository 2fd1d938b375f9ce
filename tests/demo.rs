//! `sluice demo`, the README's first command: the embedded default config, its demo upstreams
//! and its client. Traffic flows, a `curl -x` through the gateway gets 200, and the demo's
//! `https://` request goes through a CONNECT tunnel, TLS end to end.
//!
//! The demo listens on its fixed ports (8080, 9901, 9001-9003, 9443), outside the band that
//! other tests take theirs from.

mod support;

use std::process::{Command, Stdio};
use std::time::Duration;

const WAIT: Duration = Duration::from_secs(30);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_demo_shows_plain_requests_and_a_tunnel() {
    let dir = support::TempDir::new("sluice-demo");
    let log = dir.path().join("stderr.log");
    let mut child = Command::new(support::sluice_binary())
        .arg("demo")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .unwrap();
    let lines = || -> Vec<serde_json::Value> {
        std::fs::read_to_string(&log)
            .unwrap_or_default()
            .lines()
            .filter_map(|l| serde_json::from_str(l).ok())
            .collect()
    };
    let tunnelled = |l: &serde_json::Value| {
        l["target"] == "sluice::access"
            && l["route"] == "tunnel"
            && l["method"] == "CONNECT"
            && l["status"] == 200
            && l["bytes_down"].as_u64().is_some_and(|b| b > 0)
    };
    let plain = |l: &serde_json::Value| {
        l["target"] == "sluice::access" && l["route"] == "demo" && l["status"] == 200
    };
    let seen = support::wait_until(WAIT, || {
        let all = lines();
        all.iter().any(tunnelled) && all.iter().filter(|l| plain(l)).count() >= 2
    })
    .await;
    let text = std::fs::read_to_string(&log).unwrap_or_default();
    // The README's line: any host, through the gateway as HTTP_PROXY.
    let curl = Command::new("curl")
        .args([
            "-s",
            "-o",
            "/dev/null",
            "-w",
            "%{http_code}",
            "--max-time",
            "10",
        ])
        .args(["-x", "http://127.0.0.1:8080", "http://anything.test/"])
        .output()
        .expect("curl");
    let _ = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status();
    let exited = child.wait();
    assert!(
        seen,
        "no tunnel or plain traffic in the demo's log:\n{text}"
    );
    assert!(
        text.contains("through a CONNECT tunnel, TLS end to end"),
        "{text}"
    );
    assert_eq!(String::from_utf8_lossy(&curl.stdout), "200", "{text}");
    assert!(
        exited.as_ref().is_ok_and(|s| s.success()),
        "{exited:?}\n{text}"
    );
}
