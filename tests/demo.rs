//! `sluice demo`, the README's first command: the embedded default config, its demo upstreams
//! and its client, showing every policy. Each event the demo is there to show is seen, in the
//! gateway's access lines and in the demo client's own lines: round-robin and least-used
//! traffic, a quota refusing with Retry-After, a key of the pool cooling after a 429 and serving
//! again, a named client refused a route, an `https://` request through a CONNECT tunnel, and
//! the summary; and the README's `curl -x` line gets 200 as the anonymous client.
//!
//! The demo listens on its fixed ports (8080, 9901, 9001-9004, 9443), outside the band that
//! other tests take theirs from.

mod support;

use std::collections::BTreeSet;
use std::process::{Command, Stdio};
use std::time::Duration;

use serde_json::Value;

const WAIT: Duration = Duration::from_secs(90);

fn access(l: &Value, route: &str, status: u64) -> bool {
    l["target"] == "sluice::access" && l["route"] == route && l["status"] == status
}

fn demo_event(l: &Value, event: &str) -> bool {
    l["target"] == "sluice::demo" && l["event"] == event
}

/// What is still missing from the log; empty once the demo has shown everything.
fn missing(lines: &[Value]) -> Vec<&'static str> {
    let mut missing = Vec::new();
    let tunnelled = |l: &Value| {
        access(l, "tunnel", 200)
            && l["method"] == "CONNECT"
            && l["bytes_down"].as_u64().is_some_and(|b| b > 0)
    };
    if !lines.iter().any(tunnelled) || !lines.iter().any(|l| demo_event(l, "tunnel")) {
        missing.push("an https request through a CONNECT tunnel");
    }
    let plain = lines
        .iter()
        .filter(|l| access(l, "demo", 200) && l["client_name"] == "anonymous")
        .count();
    if plain < 2 {
        missing.push("round-robin answers to the anonymous client");
    }
    let pool: BTreeSet<&str> = lines
        .iter()
        .filter(|l| access(l, "pool", 200))
        .filter_map(|l| l["member"].as_str())
        .collect();
    if pool.len() < 3 {
        missing.push("the least-used pool spread over its three members");
    }
    let quota_refused = |l: &Value| access(l, "quota", 429) && l["error"] == "quota_exceeded";
    let retry_after = |l: &Value| {
        demo_event(l, "quota_refused")
            && l["retry_after"]
                .as_str()
                .and_then(|s| s.parse::<u64>().ok())
                .is_some_and(|s| s >= 1)
    };
    if !lines.iter().any(quota_refused) || !lines.iter().any(retry_after) {
        missing.push("the quota refusing with 429 and Retry-After");
    }
    // key-b cools, comes back, and then serves again.
    let cooled = lines
        .iter()
        .position(|l| demo_event(l, "key_cooled") && l["member"] == "key-b");
    let back = cooled.and_then(|at| {
        lines[at..]
            .iter()
            .position(|l| demo_event(l, "key_back") && l["member"] == "key-b")
            .map(|p| at + p)
    });
    let serves_again = back.is_some_and(|at| {
        lines[at..]
            .iter()
            .any(|l| access(l, "keys", 200) && l["member"] == "key-b")
    });
    if cooled.is_none() {
        missing.push("key-b cooling");
    }
    if back.is_none() {
        missing.push("key-b back after its cooldown");
    }
    if !serves_again {
        missing.push("key-b serving again after its cooldown");
    }
    let denied = |l: &Value| {
        access(l, "keys", 403) && l["client_name"] == "crawler" && l["error"] == "route_denied"
    };
    let said = |l: &Value| demo_event(l, "client_refused") && l["error"] == "route_denied";
    if !lines.iter().any(denied) || !lines.iter().any(said) {
        missing.push("crawler refused the keys route");
    }
    // "summary, …: demo 200×20 · keys 200×10 (key-a 4, …) · …": each route's part names its
    // 200s (a part may also count other outcomes, as "failed×1 200×20").
    let summary = |l: &Value| {
        demo_event(l, "summary")
            && l["message"].as_str().is_some_and(|m| {
                let parts: Vec<&str> = m.split(" · ").collect();
                ["demo", "pool", "quota", "keys"].iter().all(|route| {
                    parts.iter().any(|p| {
                        let p = p.rsplit(": ").next().unwrap_or(p);
                        p.strip_prefix(route)
                            .is_some_and(|rest| rest.starts_with(' ') && rest.contains(" 200×"))
                    })
                })
            })
    };
    if !lines.iter().any(summary) {
        missing.push("a summary with counts per route and status");
    }
    missing
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_demo_shows_every_policy() {
    let dir = support::TempDir::new("sluice-demo");
    let log = dir.path().join("stderr.log");
    let mut child = Command::new(support::sluice_binary())
        .arg("demo")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .unwrap();
    let lines = || -> Vec<Value> {
        std::fs::read_to_string(&log)
            .unwrap_or_default()
            .lines()
            .filter_map(|l| serde_json::from_str(l).ok())
            .collect()
    };
    let seen = support::wait_until(WAIT, || missing(&lines()).is_empty()).await;
    // The README's line: any host, through the gateway as HTTP_PROXY, with no credentials.
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
    let text = std::fs::read_to_string(&log).unwrap_or_default();
    assert!(
        seen,
        "the demo did not show {:?}:\n{text}",
        missing(&lines())
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
