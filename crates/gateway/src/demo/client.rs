//! The demo client: one loop that sends, every half second, what shows each route's policy,
//! prints one readable line per event worth seeing (a quota refusing, a key cooling and coming
//! back, a client refused, the tunnel) and a summary of every answer every 10 s.
//!
//! Each line is logged under the `sluice::demo` target with an `event` field naming it, so the
//! demo's own test (and anyone reading the JSON log) can tell them apart.

use std::collections::{BTreeMap, HashMap};
use std::fmt::Write as _;
use std::net::SocketAddr;
use std::time::Duration;

use sluice_echo::EchoServer;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::time::Instant;

use super::tunnel;

/// The keys of the `keys` route, as `configs/default.yaml` names them and sets them.
const KEYS: [(&str, &str); 3] = [
    ("key-a", "Bearer demo-key-a"),
    ("key-b", "Bearer demo-key-b"),
    ("key-c", "Bearer demo-key-c"),
];
/// The key the API stub refuses now and then, and the `Retry-After` it gives.
const REFUSED_KEY: usize = 1;
const REFUSED_FOR: &str = "2";
/// The token of the named client that is refused the `keys` route (a demo value).
const CRAWLER_TOKEN: &str = "demo-crawler-token-0001";
/// The `quota` route admits 5 in any 2 s; a burst of this many goes past it.
const BURST: usize = 7;
const TICK: Duration = Duration::from_millis(500);
const SUMMARY_EVERY: Duration = Duration::from_secs(10);

/// One answer as the demo client saw it.
struct Answer {
    status: u16,
    /// `x-upstream`: which demo upstream answered.
    upstream: Option<String>,
    /// `x-sluice-error`: why sluice refused.
    error: Option<String>,
    retry_after: Option<String>,
}

/// Answers per route and status since the demo started, and who served them.
#[derive(Default)]
struct Counts {
    /// (route as the summary names it, status; 0 when no answer came).
    answers: BTreeMap<(&'static str, u16), u64>,
    /// Answers of the least-used pool, per upstream.
    pool: BTreeMap<String, u64>,
}

impl Counts {
    fn add(&mut self, route: &'static str, status: u16) {
        *self.answers.entry((route, status)).or_default() += 1;
    }

    /// `demo 200×20 · quota 200×10 429×4 · …`, routes by name.
    fn line(&self, api: Option<&EchoServer>) -> String {
        let mut out = String::new();
        let mut last = "";
        for (&(route, status), n) in &self.answers {
            if route != last {
                if !last.is_empty() {
                    out.push_str(extra(last, &self.pool, api).as_str());
                    out.push_str(" · ");
                }
                out.push_str(route);
                last = route;
            }
            let status = if status == 0 {
                "failed".to_string()
            } else {
                status.to_string()
            };
            let _ = write!(out, " {status}×{n}");
        }
        if !last.is_empty() {
            out.push_str(extra(last, &self.pool, api).as_str());
        }
        out
    }
}

/// What a route's summary adds: who served the least-used pool, and each key's answers.
fn extra(route: &str, pool: &BTreeMap<String, u64>, api: Option<&EchoServer>) -> String {
    match route {
        "pool" if !pool.is_empty() => {
            let each: Vec<String> = pool.iter().map(|(m, n)| format!("{m} {n}")).collect();
            format!(" ({})", each.join(", "))
        }
        "keys" => match api {
            Some(api) => {
                let each: Vec<String> = KEYS
                    .iter()
                    .map(|(name, key)| format!("{name} {}", api.served(key)))
                    .collect();
                format!(" ({})", each.join(", "))
            }
            None => String::new(),
        },
        _ => String::new(),
    }
}

/// Runs the demo client until the process ends.
pub(super) async fn run(
    gateway: SocketAddr,
    admin: SocketAddr,
    api: Option<EchoServer>,
    tls: Option<tunnel::Tls>,
) {
    let mut counts = Counts::default();
    let mut next_summary = Instant::now() + SUMMARY_EVERY;
    // Each key's cooldown as last seen in /status: Some(since) while it cools.
    let mut cooling: HashMap<String, Instant> = HashMap::new();
    let mut scripted: u64 = 0;
    let mut n: u64 = 0;
    loop {
        n += 1;
        let started = Instant::now();

        // Round-robin, as any host: the access line says which upstream answered.
        let answer = send(gateway, "demo.local", &format!("/hello?n={n}"), None).await;
        counts.add("demo", answer.status);

        // Least-used, on the ticks in between the key pool's.
        if n.is_multiple_of(2) {
            let answer = send(gateway, "pool.demo", "/", None).await;
            counts.add("pool", answer.status);
            if let Some(upstream) = answer.upstream {
                *counts.pool.entry(upstream).or_default() += 1;
            }
        } else {
            // The pool of keys. Now and then the API refuses key-b once, as a provider does at
            // a key's limit; a refusal is scripted again only once the last one was answered.
            if let Some(api) = &api {
                let key = KEYS[REFUSED_KEY].1;
                if n % 30 == 7
                    && api.refused(key) >= scripted
                    && api.refuse_next(key, 1, REFUSED_FOR).is_ok()
                {
                    scripted += 1;
                }
            }
            let answer = send(gateway, "keys.demo", "/v1/models", None).await;
            counts.add("keys", answer.status);
        }
        // Right after the key pool's request, which may have set a cooldown: read later (after
        // a burst, on a loaded machine) a 2 s cooldown could be over before anyone saw it.
        watch_cooldowns(admin, &mut cooling).await;

        // A burst past the quota: 5 in any 2 s are admitted, the rest get 429 and Retry-After.
        if n % 16 == 4 {
            let (mut admitted, mut refused, mut retry_after) = (0, 0, None);
            for i in 0..BURST {
                let answer = send(gateway, "quota.demo", &format!("/items/{i}"), None).await;
                counts.add("quota", answer.status);
                match answer.status {
                    200 => admitted += 1,
                    429 => {
                        refused += 1;
                        retry_after = retry_after.or(answer.retry_after);
                    }
                    _ => {}
                }
            }
            if refused > 0 {
                let retry_after = retry_after.unwrap_or_else(|| "-".into());
                tracing::info!(
                    target: "sluice::demo",
                    event = "quota_refused", route = "quota", admitted, refused, retry_after = %retry_after,
                    "quota: a burst of {BURST}: {admitted} admitted, {refused} refused with 429 quota_exceeded and Retry-After: {retry_after} s (the quota is 5 in any 2 s)"
                );
            }
        }

        // A named client asking for a route it was not given.
        if n % 20 == 6 {
            let answer = send(gateway, "keys.demo", "/v1/models", Some(CRAWLER_TOKEN)).await;
            counts.add("keys as crawler", answer.status);
            let error = answer.error.unwrap_or_else(|| "-".into());
            tracing::info!(
                target: "sluice::demo",
                event = "client_refused", client = "crawler", route = "keys", status = answer.status, error = %error,
                "client crawler asked for route keys: {} {error} (its routes are demo and pool)",
                answer.status
            );
        }

        // HTTPS through a CONNECT tunnel.
        if let Some(tls) = tls.as_ref().filter(|_| n % 10 == 1) {
            match tls.get(gateway).await {
                Ok(status) => {
                    counts.add("tunnel", status);
                    tracing::info!(
                        target: "sluice::demo",
                        event = "tunnel", request = n, status,
                        "demo client: GET https://{}:9443/ through a CONNECT tunnel, TLS end to end: {status}",
                        tunnel::HOST
                    );
                }
                Err(e) => {
                    counts.add("tunnel", 0);
                    tracing::warn!(target: "sluice::demo", event = "tunnel", request = n, error = %e, "demo client: https through a tunnel");
                }
            }
        }

        if Instant::now() >= next_summary {
            next_summary = Instant::now() + SUMMARY_EVERY;
            tracing::info!(
                target: "sluice::demo",
                event = "summary",
                "summary, answers per route and status since the start: {}",
                counts.line(api.as_ref())
            );
        }
        tokio::time::sleep_until(started + TICK).await;
    }
}

/// Reads the keys' cooldowns from `/status` and says when one starts or ends.
async fn watch_cooldowns(admin: SocketAddr, cooling: &mut HashMap<String, Instant>) {
    let Some(status) = status(admin).await else {
        return;
    };
    let Some(members) = status["routes"].as_array().and_then(|routes| {
        routes
            .iter()
            .find(|r| r["name"] == "keys")
            .and_then(|r| r["members"].as_array())
    }) else {
        return;
    };
    for member in members {
        let Some(name) = member["name"].as_str() else {
            continue;
        };
        match (member["cooling_ms"].as_u64(), cooling.contains_key(name)) {
            (Some(ms), false) => {
                cooling.insert(name.to_string(), Instant::now());
                let secs = ms.div_ceil(1000);
                tracing::info!(
                    target: "sluice::demo",
                    event = "key_cooled", member = name, cooling_ms = ms,
                    "{name} cooled for {secs} s after a 429 from the API; the other keys take its requests"
                );
            }
            (None, true) => {
                let since = cooling.remove(name).map(|t| t.elapsed());
                let secs = since.map_or(0.0, |d| d.as_secs_f64());
                tracing::info!(
                    target: "sluice::demo",
                    event = "key_back", member = name,
                    "{name} is back after its cooldown (seen cooling for {secs:.1} s)"
                );
            }
            _ => {}
        }
    }
}

/// `GET /status` of the admin API, parsed; None if it does not answer.
async fn status(admin: SocketAddr) -> Option<serde_json::Value> {
    let request = "GET /status HTTP/1.1\r\nHost: sluice\r\nConnection: close\r\n\r\n";
    let raw = exchange(admin, request).await.ok()?;
    let text = String::from_utf8_lossy(&raw);
    let (_, body) = text.split_once("\r\n\r\n")?;
    serde_json::from_str(body).ok()
}

/// One request through the gateway as a forward proxy, as `crawler` when given its token.
async fn send(gateway: SocketAddr, host: &str, path: &str, token: Option<&str>) -> Answer {
    let auth = token
        .map(|t| format!("Proxy-Authorization: Bearer {t}\r\n"))
        .unwrap_or_default();
    let request = format!(
        "GET http://{host}{path} HTTP/1.1\r\nHost: {host}\r\n{auth}Connection: close\r\n\r\n"
    );
    match exchange(gateway, &request).await {
        Ok(raw) => parse(&raw),
        Err(e) => {
            tracing::warn!(target: "sluice::demo", host, path, error = %e, "demo client: no answer");
            Answer {
                status: 0,
                upstream: None,
                error: None,
                retry_after: None,
            }
        }
    }
}

/// Sends `request` on a new connection and reads the answer to its end.
async fn exchange(to: SocketAddr, request: &str) -> std::io::Result<Vec<u8>> {
    let timed_out =
        |what: &str| std::io::Error::new(std::io::ErrorKind::TimedOut, what.to_string());
    let mut conn = tokio::time::timeout(Duration::from_secs(2), tokio::net::TcpStream::connect(to))
        .await
        .map_err(|_| timed_out("connect timed out"))??;
    conn.write_all(request.as_bytes()).await?;
    let mut buf = Vec::new();
    tokio::time::timeout(Duration::from_secs(5), conn.read_to_end(&mut buf))
        .await
        .map_err(|_| timed_out("response timed out"))??;
    Ok(buf)
}

/// The status and the few headers the demo prints.
fn parse(raw: &[u8]) -> Answer {
    let text = String::from_utf8_lossy(raw);
    let head = text.split("\r\n\r\n").next().unwrap_or_default();
    let header = |name: &str| {
        head.lines().skip(1).find_map(|l| {
            let (k, v) = l.split_once(':')?;
            k.trim()
                .eq_ignore_ascii_case(name)
                .then(|| v.trim().to_string())
        })
    };
    Answer {
        status: head
            .split(' ')
            .nth(1)
            .and_then(|s| s.parse().ok())
            .unwrap_or(0),
        upstream: header("x-upstream"),
        error: header("x-sluice-error"),
        retry_after: header("retry-after"),
    }
}
