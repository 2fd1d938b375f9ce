//! Hot reload end to end: each trigger, bad files, state that survives, the admin token, and
//! fifty reloads under steady load without one failed request.

mod support;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use support::{
    dead_url, request, start_backends, url, Config, Gateway, HealthCheck, HttpClient, Passive,
    Quota, Response, Route,
};

/// A config (two proxy threads) with `routes`, as YAML with `{PROXY}` and `{ADMIN}` left in.
fn config(routes: &[Route]) -> String {
    Config::new().threads(2).routes(routes.to_vec()).yaml()
}

/// Route `name` on host `<name>.test` over `members`.
fn route(name: &str, members: &[String]) -> Route {
    Route::new(name).members(members)
}

/// The fast active check of route `k`.
fn active() -> HealthCheck {
    HealthCheck::fast_http("100ms", 1, 1)
}

async fn status_of(gw: &Gateway, host: &str) -> u16 {
    request(gw.proxy_addr(), "GET", host, "/", &[], b"")
        .await
        .status
}

/// `POST /reload`, with the header a POST needs when no admin token is configured.
async fn post_reload(gw: &Gateway, headers: &[(&str, &str)]) -> Response {
    let mut headers = headers.to_vec();
    headers.push(("X-Sluice-Admin", "1"));
    request(gw.admin_addr(), "POST", "admin", "/reload", &headers, b"").await
}

async fn eventually<F, Fut>(what: &str, f: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let ok = support::wait_until_async(Duration::from_secs(20), f).await;
    assert!(ok, "{what}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_trigger_takes_effect() {
    let backends = start_backends(&["b1"]).await;
    let m = vec![url(backends[0].local_addr())];
    let gw = Gateway::start_with_ports(&config(&[route("a", &m)]));
    assert_eq!(status_of(&gw, "b.test").await, 404);

    // An atomic rename over the file, as editors and ConfigMaps do.
    gw.write_config_template(&config(&[route("a", &m), route("b", &m)]));
    eventually("the renamed file is loaded", || async {
        status_of(&gw, "b.test").await == 200
    })
    .await;

    // An in-place write.
    std::fs::write(
        gw.config_path(),
        config(&[route("a", &m), route("c", &m)])
            .replace("{PROXY}", &gw.proxy_addr().to_string())
            .replace("{ADMIN}", &gw.admin_addr().to_string()),
    )
    .unwrap();
    eventually("the rewritten file is loaded", || async {
        status_of(&gw, "c.test").await == 200
    })
    .await;
    assert_eq!(
        status_of(&gw, "b.test").await,
        404,
        "a removed route answers 404"
    );

    // SIGHUP. The watcher sees the same change (it also follows a symlinked config to its
    // target), so whichever comes first loads it; the signal must be handled and logged either
    // way ("config reloaded" or "config unchanged").
    gw.write_config_template(&config(&[route("a", &m), route("d", &m)]));
    gw.signal("HUP");
    eventually("SIGHUP reloads", || async {
        status_of(&gw, "d.test").await == 200
    })
    .await;
    assert!(
        support::wait_until(Duration::from_secs(20), || gw
            .logs()
            .contains("\"trigger\":\"sighup\""))
        .await,
        "{}",
        gw.logs()
    );

    // POST /reload: in force as soon as it returns.
    gw.write_config_template(&config(&[route("a", &m), route("e", &m)]));
    let r = post_reload(&gw, &[]).await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(status_of(&gw, "e.test").await, 200);
    assert_eq!(status_of(&gw, "d.test").await, 404);
    let status = gw.status().await;
    assert_eq!(r.json()["version"], status["version"]);
    assert!(status["last_reload_error"].is_null());
    assert!(
        gw.metric("sluice_config_reloads_total", &[("result", "ok")])
            .await
            .unwrap()
            >= 4.0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bad_file_changes_nothing_and_says_why() {
    let backends = start_backends(&["b1"]).await;
    let m = vec![url(backends[0].local_addr())];
    let good = config(&[route("a", &m)]);
    let gw = Gateway::start_with_ports(&good);
    let version = gw.status().await["version"].clone();
    let file = gw.config_path().display().to_string();
    let bad_files = [
        // These two are about the text itself, so they edit the YAML.
        (
            "a syntax error",
            good.replacen("name: a", "name: \"a", 1),
            "quoted scalar",
        ),
        (
            "an unknown key",
            good.replacen("upstream:", "upstreams:", 1),
            "unknown field `upstreams`",
        ),
        (
            "a duplicate route",
            config(&[route("a", &m), route("a", &m)]),
            "duplicate route name",
        ),
    ];
    for (i, (what, yaml, expected)) in bad_files.iter().enumerate() {
        gw.write_config_template(yaml);
        let r = post_reload(&gw, &[]).await;
        assert_eq!(r.status, 400, "{what}: {}", r.text());
        let error = r.json()["error"].as_str().unwrap().to_string();
        assert!(
            error.starts_with(&format!("{file}:")),
            "{what}: FILE:LINE:COL first: {error}"
        );
        assert!(error.contains(expected), "{what}: {error}");
        let status = gw.status().await;
        assert_eq!(status["version"], version, "{what}: the old config stays");
        assert_eq!(status["last_reload_error"].as_str(), Some(error.as_str()));
        assert_eq!(
            status_of(&gw, "a.test").await,
            200,
            "{what}: the old config still serves"
        );
        // The file watcher may reload (and fail) on its own too; count at least ours.
        let errors = gw
            .metric("sluice_config_reloads_total", &[("result", "error")])
            .await
            .unwrap_or(0.0);
        assert!(errors >= (i + 1) as f64);
    }
    assert!(gw.logs().contains("config reload failed"));
    gw.write_config_template(&good);
    assert_eq!(post_reload(&gw, &[]).await.status, 200);
    assert!(gw.status().await["last_reload_error"].is_null());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn state_survives_a_reload_that_touches_another_route() {
    let backends = start_backends(&["alive", "checked"]).await;
    let alive = url(backends[0].local_addr());
    let checked = url(backends[1].local_addr());
    let dead = dead_url();
    let routes = vec![
        route("q", std::slice::from_ref(&alive)).quota(Quota::window("minute", 3, "1m")),
        route("h", &[dead.clone(), alive.clone()]).passive(Passive::cooldown("1h")),
        route("k", std::slice::from_ref(&checked)).health_check(active()),
    ];
    let gw = Gateway::start_with_ports(&config(&routes));

    for _ in 0..3 {
        assert_eq!(status_of(&gw, "q.test").await, 200);
    }
    assert_eq!(status_of(&gw, "q.test").await, 429);
    for _ in 0..2 {
        assert_eq!(status_of(&gw, "h.test").await, 200);
    }
    let failures = [("member", dead.as_str()), ("outcome", "connect_failure")];
    assert_eq!(
        gw.metric("sluice_upstream_attempts_total", &failures).await,
        Some(1.0)
    );
    backends[1].set_healthy(false);
    let down = [("route", "k"), ("member", checked.as_str())];
    eventually("the active check marks k's member down", || async {
        gw.metric("sluice_member_healthy", &down).await == Some(0.0)
    })
    .await;

    // Touch another route only.
    let mut more = routes.clone();
    more.push(route("other", std::slice::from_ref(&alive)));
    gw.write_config_template(&config(&more));
    assert_eq!(post_reload(&gw, &[]).await.status, 200);

    assert_eq!(
        status_of(&gw, "q.test").await,
        429,
        "the filled quota still refuses"
    );
    // Right after the reload, health is what it was: no flap back to up.
    let status = gw.status().await;
    let members = |name: &str| -> Vec<serde_json::Value> {
        status["routes"]
            .as_array()
            .unwrap()
            .iter()
            .find(|r| r["name"] == name)
            .unwrap()["members"]
            .as_array()
            .unwrap()
            .clone()
    };
    assert_eq!(members("k")[0]["healthy"], false);
    assert_eq!(members("h")[0]["healthy"], false);
    for _ in 0..10 {
        assert_eq!(status_of(&gw, "h.test").await, 200);
    }
    assert_eq!(
        gw.metric("sluice_upstream_attempts_total", &failures).await,
        Some(1.0),
        "no trial traffic to the down member"
    );
    assert_eq!(
        gw.logs().matches("member down").count(),
        2,
        "one per member, no flap: {}",
        gw.logs()
    );
    assert!(!gw.logs().contains("member up"));

    // Now change k's own pool (a member added): its surviving member keeps its health too.
    backends[1].set_healthy(true);
    eventually("k's member comes back", || async {
        gw.metric("sluice_member_healthy", &down).await == Some(1.0)
    })
    .await;
    more[2] = route("k", &[checked.clone(), alive.clone()]).health_check(active());
    gw.write_config_template(&config(&more));
    assert_eq!(post_reload(&gw, &[]).await.status, 200);
    assert_eq!(gw.metric("sluice_member_healthy", &down).await, Some(1.0));
    // The line goes out through the log writer's thread, after the gauge moved: waited for,
    // then counted.
    assert!(
        gw.wait_for_log("member up", Duration::from_secs(20)).await,
        "{}",
        gw.logs()
    );
    assert_eq!(gw.logs().matches("member up").count(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn post_reload_needs_the_admin_token_when_one_is_configured() {
    let backends = start_backends(&["b1"]).await;
    let m = vec![url(backends[0].local_addr())];
    // A variable of this test's own; the gateway inherits the test's environment.
    std::env::set_var("SLUICE_TEST_RELOAD_TOKEN", "s3cret");
    let gw = Config::new()
        .threads(2)
        .admin_token_env("SLUICE_TEST_RELOAD_TOKEN")
        .route(route("a", &m))
        .start();
    assert_eq!(post_reload(&gw, &[]).await.status, 401);
    assert_eq!(
        post_reload(&gw, &[("Authorization", "Bearer wrong")])
            .await
            .status,
        401
    );
    assert_eq!(
        post_reload(&gw, &[("Authorization", "Bearer s3cret")])
            .await
            .status,
        200
    );
    // GET endpoints stay open.
    assert_eq!(gw.admin("/status").await.status, 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fifty_reloads_under_load_fail_no_request() {
    let backends = start_backends(&["b1", "b2", "b3"]).await;
    let m: Vec<String> = backends.iter().map(|b| url(b.local_addr())).collect();
    let one_window = Quota::window("minute", 1_000_000, "1m");
    let two_windows = one_window.clone().and_window("second", 100_000, "1s");
    let a = config(&[
        route("steady", &m[..2]).quota(one_window),
        route("x", &m[..1]),
    ]);
    let b = config(&[
        route("steady", &m).quota(two_windows),
        route("y", &m[1..]),
        route("z", &m[2..]),
    ]);
    let gw = Gateway::start_with_ports(&a);

    let stop = Arc::new(AtomicBool::new(false));
    let sent = Arc::new(AtomicU64::new(0));
    let mut clients = Vec::new();
    for _ in 0..4 {
        let (addr, stop, sent) = (gw.proxy_addr(), stop.clone(), sent.clone());
        clients.push(tokio::spawn(async move {
            let mut client = HttpClient::connect(addr).await.unwrap();
            let mut failures = Vec::new();
            // Bounded: at most 20,000 requests per client.
            for _ in 0..20_000 {
                if stop.load(Ordering::Relaxed) {
                    break;
                }
                match client
                    .request("POST", "steady.test", "/", &[], b"payload")
                    .await
                {
                    Ok(r) if r.status == 200 => {}
                    Ok(r) => failures.push(format!("{} {}", r.status, r.text())),
                    Err(e) => failures.push(e.to_string()),
                }
                sent.fetch_add(1, Ordering::Relaxed);
            }
            failures
        }));
    }
    for i in 0..50 {
        gw.write_config_template(if i % 2 == 0 { &b } else { &a });
        let r = post_reload(&gw, &[]).await;
        assert_eq!(r.status, 200, "reload {i}: {}", r.text());
        // Let traffic flow on this config before the next reload: wait for requests, not for
        // a moment, so every config in the series really serves some.
        let after_reload = sent.load(Ordering::Relaxed);
        let flowed = support::wait_until(Duration::from_secs(20), || {
            sent.load(Ordering::Relaxed) >= after_reload + 8
        })
        .await;
        assert!(flowed, "requests flow after reload {i}");
    }
    stop.store(true, Ordering::Relaxed);
    let mut failures = Vec::new();
    for c in clients {
        failures.extend(c.await.unwrap());
    }
    println!(
        "{} requests during 50 reloads",
        sent.load(Ordering::Relaxed)
    );
    assert!(
        failures.is_empty(),
        "{} failed: {:?}",
        failures.len(),
        &failures[..failures.len().min(5)]
    );
    assert!(sent.load(Ordering::Relaxed) >= 200);
    assert!(
        gw.metric("sluice_config_reloads_total", &[("result", "ok")])
            .await
            .unwrap()
            >= 50.0
    );
}

/// An editor that truncates the file and rewrites it in place, in small chunks, once made the
/// watcher load an empty file (`routes: []`, every request 404) or half a file (one route
/// missing). Every rewrite here is slow and chunked, under load; no request may fail, and
/// every finished rewrite must still be picked up.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_in_place_rewrites_under_load_fail_no_request() {
    use std::io::Write;
    let backends = start_backends(&["b1", "b2"]).await;
    let m: Vec<String> = backends.iter().map(|b| url(b.local_addr())).collect();
    // Many routes, so that a torn file is missing some; clients use the first and the last.
    let version = |limit: u64| {
        let mut routes = vec![route("first", &m).quota(Quota::window("minute", limit, "1m"))];
        for i in 0..30 {
            routes.push(route(&format!("r{i}"), &m[..1]));
        }
        routes.push(route("last", &m[1..]));
        config(&routes)
    };
    let gw = Gateway::start_with_ports(&version(1_000_000));
    // The file as the gateway wrote it, with its real ports, for in-place rewrites.
    let live = std::fs::read_to_string(gw.config_path()).unwrap();
    assert!(live.contains("1000000"));
    let template = live.replace("1000000", "LIMIT");

    let stop = Arc::new(AtomicBool::new(false));
    let mut clients = Vec::new();
    for host in ["first.test", "last.test"] {
        let (addr, stop) = (gw.proxy_addr(), stop.clone());
        clients.push(tokio::spawn(async move {
            let mut client = HttpClient::connect(addr).await.unwrap();
            let mut failures = Vec::new();
            for _ in 0..50_000 {
                if stop.load(Ordering::Relaxed) {
                    break;
                }
                match client.request("GET", host, "/", &[], b"").await {
                    Ok(r) if r.status == 200 => {}
                    Ok(r) => failures.push(format!("{host}: {} {}", r.status, r.text())),
                    Err(e) => failures.push(format!("{host}: {e}")),
                }
            }
            failures
        }));
    }
    for round in 0..4u64 {
        let text = template.replace("LIMIT", &(1_000_000 + (round + 1) % 2).to_string());
        let path = gw.config_path();
        // Truncate, then write a line at a time with a pause between writes that is shorter
        // than the watcher's quiet period, as a script echoing line by line would. Many of
        // the partial files are valid YAML with routes missing.
        tokio::task::spawn_blocking(move || {
            let mut file = std::fs::File::create(&path).unwrap();
            for line in text.split_inclusive('\n') {
                file.write_all(line.as_bytes()).unwrap();
                file.flush().unwrap();
                std::thread::sleep(Duration::from_millis(10));
            }
        })
        .await
        .unwrap();
        let written = std::fs::read(gw.config_path()).unwrap();
        let want = sha256_hex(&written);
        eventually("the finished rewrite is loaded", || async {
            gw.status().await["version"] == want.as_str()
        })
        .await;
    }
    stop.store(true, Ordering::Relaxed);
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
}

/// The sha256 of `bytes` in hex, as `/status` shows a config's version.
fn sha256_hex(bytes: &[u8]) -> String {
    use sha2::Digest;
    hex::encode(sha2::Sha256::digest(bytes))
}

/// A writer that rewrites the file in place and stalls half-way with the file still open (a
/// process descheduled under load) must never get its half file loaded, however long the
/// stall: the file is loaded when the writer closes it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_writer_stalled_mid_file_is_loaded_only_when_it_closes_the_file() {
    use std::io::Write;
    let backends = start_backends(&["b1"]).await;
    let m = vec![url(backends[0].local_addr())];
    let gw = Gateway::start_with_ports(&config(&[route("a", &m), route("b", &m)]));
    let live = std::fs::read_to_string(gw.config_path()).unwrap();
    // The new config adds route `c` before `b`; its first half (up to `b`) is a valid config
    // that lacks `b`, which both the old and the new config serve.
    let full = config(&[route("a", &m), route("c", &m), route("b", &m)])
        .replace("{PROXY}", &gw.proxy_addr().to_string())
        .replace("{ADMIN}", &gw.admin_addr().to_string());
    let cut = full.find("- name: b\n").expect("route b in the YAML");
    let (half, rest) = (full[..cut].to_string(), full[cut..].to_string());
    assert!(half.contains("name: c"), "{half}");
    let half_version = sha256_hex(half.as_bytes());
    let full_version = sha256_hex(full.as_bytes());

    // An in-place write, closed, is loaded: the watcher has seen a close, so from then on the
    // platform is known to report closes.
    let primed = format!("{live}# primed\n");
    std::fs::write(gw.config_path(), &primed).unwrap();
    let primed_version = sha256_hex(primed.as_bytes());
    eventually("the closed in-place write is loaded", || async {
        gw.status().await["version"] == primed_version.as_str()
    })
    .await;

    // Watch what the gateway serves while the file is torn.
    let stop = Arc::new(AtomicBool::new(false));
    let watcher = {
        let (stop, proxy, admin) = (stop.clone(), gw.proxy_addr(), gw.admin_addr());
        let half_version = half_version.clone();
        tokio::spawn(async move {
            let mut seen = Vec::new();
            let mut client = HttpClient::connect(proxy).await.unwrap();
            while !stop.load(Ordering::Relaxed) {
                let status = support::admin_get(admin, "/status").await.json();
                if status["version"] == half_version.as_str() {
                    seen.push("the half file in force".to_string());
                }
                match client.request("GET", "b.test", "/", &[], b"").await {
                    Ok(r) if r.status == 200 => {}
                    Ok(r) => seen.push(format!("b.test: {} {}", r.status, r.text())),
                    Err(e) => seen.push(format!("b.test: {e}")),
                }
            }
            seen
        })
    };

    let path = gw.config_path();
    let (stalled_tx, stalled_rx) = std::sync::mpsc::channel::<()>();
    let writer = std::thread::spawn(move || {
        let mut file = std::fs::File::create(&path).unwrap();
        file.write_all(half.as_bytes()).unwrap();
        file.flush().unwrap();
        // The stall: far longer than any quiet period a watcher could wait for.
        std::thread::sleep(Duration::from_millis(1500));
        file.write_all(rest.as_bytes()).unwrap();
        file.flush().unwrap();
        stalled_tx.send(()).unwrap();
        drop(file);
    });
    // The whole file is loaded after the close.
    eventually("the whole file is loaded once closed", || async {
        gw.status().await["version"] == full_version.as_str()
    })
    .await;
    stalled_rx.recv().unwrap();
    writer.join().unwrap();
    assert_eq!(status_of(&gw, "c.test").await, 200);
    stop.store(true, Ordering::Relaxed);
    let seen = watcher.await.unwrap();
    assert!(
        seen.is_empty(),
        "the torn file was served: {} bad observations, e.g. {:?}",
        seen.len(),
        &seen[..seen.len().min(5)]
    );
}

/// Where no close is reported for a write (polling watchers, some container mounts), a change
/// is still loaded once the file's content has settled, even with the writer holding it open.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_change_without_a_close_is_loaded_once_it_settles() {
    use std::io::Write;
    let backends = start_backends(&["b1"]).await;
    let m = vec![url(backends[0].local_addr())];
    let gw = Gateway::start_with_ports(&config(&[route("a", &m)]));
    let full = config(&[route("a", &m), route("c", &m)])
        .replace("{PROXY}", &gw.proxy_addr().to_string())
        .replace("{ADMIN}", &gw.admin_addr().to_string());
    let mut file = std::fs::File::create(gw.config_path()).unwrap();
    file.write_all(full.as_bytes()).unwrap();
    file.flush().unwrap();
    let want = sha256_hex(full.as_bytes());
    eventually(
        "the settled file is loaded with its writer still open",
        || async { gw.status().await["version"] == want.as_str() },
    )
    .await;
    drop(file);
    assert_eq!(status_of(&gw, "c.test").await, 200);
}
