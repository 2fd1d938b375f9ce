//! Calendar windows and usage units wherever a window can be, end to end on both stores: a
//! route's own calendar window counting requests, a member's and a client's, each refusing at
//! its limit until the period's boundary (the `Retry-After` is the time to it), and a client's
//! budget in dollars charged on the routes that price dollars, settled to what each answer
//! used, and not at all on a route that does not define the unit; the same on a Redis Cluster,
//! where a client's windows are in a slot of their own. A retry to another key charges and
//! settles that key's calendar window too. Expected boundaries come from
//! the test's own clock, in a fixed-offset zone (`Etc/GMT-h`) chosen when the test runs so that
//! its local time is about noon: no day or month ends within hours of a test, whenever it runs,
//! and plain arithmetic finds the next midnight.

mod support;

use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use serde_json::{json, Value};
use sluice_echo::openai::OpenAiStub;
use sluice_testkit::RedisCluster;
use support::{
    request, start_backends, url, wait_until_async, Backend, Config, Gateway, HttpClient,
    KeyMember, Passive, Response, Route, State, Store,
};

on_both_stores!(
    a_routes_calendar_day_counting_requests_refuses_until_local_midnight,
    a_members_calendar_window_refuses_until_midnight,
    a_clients_calendar_window_refuses_until_local_midnight,
    a_clients_dollar_budget_settles_exactly_on_routes_that_price_dollars,
    a_retry_charges_the_next_members_calendar_window_and_settles_it,
);

const DAY: i64 = 86_400;
const BILLING: &str = "billing-token-0123456789";

fn now_secs() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs_f64()
}

/// A zone without summer time whose local time is about noon now, and its offset east of UTC
/// in seconds (`Etc/GMT-h` is h hours east), so that no period's boundary comes near a test.
fn noon_zone() -> (String, i64) {
    let utc_hour = (now_secs() as i64 / 3600) % 24;
    let h = 12 - utc_hour;
    let name = match h {
        0 => "Etc/GMT".to_string(),
        h if h > 0 => format!("Etc/GMT-{h}"),
        h => format!("Etc/GMT+{}", -h),
    };
    (name, h * 3600)
}

/// `yaml` with every calendar window's `tz` set to `zone`, wherever the window is.
fn in_zone(yaml: &str, zone: &str) -> String {
    fn walk(v: &mut Value, zone: &str) {
        match v {
            Value::Object(map) => {
                let calendar = map
                    .get("window")
                    .and_then(Value::as_str)
                    .is_some_and(|w| w.starts_with("calendar_"));
                if calendar {
                    map.insert("tz".into(), zone.into());
                }
                map.values_mut().for_each(|v| walk(v, zone));
            }
            Value::Array(items) => items.iter_mut().for_each(|v| walk(v, zone)),
            _ => {}
        }
    }
    let mut config: Value = serde_yaml::from_str(yaml).unwrap();
    walk(&mut config, zone);
    serde_yaml::to_string(&config).unwrap()
}

/// The next midnight, in Unix seconds, of the zone `offset` seconds east of UTC (no summer
/// time), after `at`.
fn next_midnight(at: f64, offset: i64) -> f64 {
    let local = at as i64 + offset;
    ((local.div_euclid(DAY) + 1) * DAY - offset) as f64
}

/// Asserts that the refusal `r`, answered between `before` and `after` (Unix seconds), waits
/// until the boundary: its `Retry-After` (whole seconds, rounded up) is at most the time from
/// `before` to it, and more than the time from `after` to it less a minute, whatever the run's
/// timing.
fn waits_until(r: &Response, boundary: f64, before: f64, after: f64) {
    let retry: f64 = r
        .header("retry-after")
        .expect("a Retry-After")
        .parse()
        .unwrap();
    assert!(
        retry <= (boundary - before).ceil() && retry > boundary - after - 60.0,
        "Retry-After {retry}s, the boundary {}s away",
        boundary - before
    );
}

/// `yaml` with `value` set at the path of keys `at`.
fn set(yaml: &str, at: &[&str], value: &str) -> String {
    let mut config: Value = serde_yaml::from_str(yaml).unwrap();
    let mut node = &mut config;
    for key in at {
        node = match key.parse::<usize>() {
            Ok(i) => &mut node[i],
            Err(_) => &mut node[*key],
        };
    }
    *node = serde_yaml::from_str(value).unwrap();
    serde_yaml::to_string(&config).unwrap()
}

async fn get(client: &mut HttpClient, host: &str, auth: Option<&str>) -> Response {
    let auth = auth.map(|t| format!("Bearer {t}"));
    let headers: Vec<(&str, &str)> = auth
        .iter()
        .map(|a| ("Proxy-Authorization", a.as_str()))
        .collect();
    client
        .request("GET", host, "/", &headers, b"")
        .await
        .unwrap()
}

/// A plain route's `{limit: 3, window: calendar_day}` (in the noon zone) counts requests:
/// three go, the fourth is refused until the zone's next midnight, and reaches no member.
async fn a_routes_calendar_day_counting_requests_refuses_until_local_midnight(backend: Backend) {
    let store = Store::start(backend);
    route_calendar_day(Config::new().store(&store)).await;
}

async fn route_calendar_day(config: Config) {
    let backends = start_backends(&["b1"]).await;
    let base = config
        .route(Route::new("api").member(url(backends[0].local_addr())))
        .yaml();
    let yaml = set(
        &base,
        &["routes", "0", "quota"],
        "windows: [{ name: day, limit: 3, window: calendar_day }]",
    );
    let (zone, offset) = noon_zone();
    let gw = Gateway::start_with_ports(&in_zone(&yaml, &zone));
    let mut client = HttpClient::connect(gw.proxy_addr()).await.unwrap();
    for _ in 0..3 {
        assert_eq!(get(&mut client, "api.test", None).await.status, 200);
    }
    let before = now_secs();
    let refused = get(&mut client, "api.test", None).await;
    let after = now_secs();
    assert_eq!(refused.status, 429, "{}", refused.text());
    assert_eq!(refused.header("x-sluice-error"), Some("quota_exceeded"));
    waits_until(&refused, next_midnight(before, offset), before, after);
    assert_eq!(backends[0].proxied_requests(), 3);
}

/// Two keys with `{limit: 2, window: calendar_day}` each: four requests go, the fifth finds
/// every key full until midnight.
async fn a_members_calendar_window_refuses_until_midnight(backend: Backend) {
    let store = Store::start(backend);
    member_calendar_day(Config::new().store(&store)).await;
}

async fn member_calendar_day(config: Config) {
    let backends = start_backends(&["b1", "b2"]).await;
    let route = Route::new("api")
        .key_member(KeyMember::new(url(backends[0].local_addr()), "k1").window(
            "day",
            2,
            "calendar_day",
        ))
        .key_member(KeyMember::new(url(backends[1].local_addr()), "k2").window(
            "day",
            2,
            "calendar_day",
        ));
    let (zone, offset) = noon_zone();
    let gw = Gateway::start_with_ports(&in_zone(&config.route(route).yaml(), &zone));
    let mut client = HttpClient::connect(gw.proxy_addr()).await.unwrap();
    for _ in 0..4 {
        assert_eq!(get(&mut client, "api.test", None).await.status, 200);
    }
    let before = now_secs();
    let refused = get(&mut client, "api.test", None).await;
    let after = now_secs();
    assert_eq!(refused.status, 429, "{}", refused.text());
    waits_until(&refused, next_midnight(before, offset), before, after);
    let sent: Vec<u64> = backends.iter().map(|b| b.proxied_requests()).collect();
    assert_eq!(sent, [2, 2]);
}

/// A client's own `{limit: 2, window: calendar_day}` counts its requests on a route without a
/// quota: the third is refused, naming the client's window, until midnight; another client is
/// not limited by it.
async fn a_clients_calendar_window_refuses_until_local_midnight(backend: Backend) {
    let store = Store::start(backend);
    client_calendar_day(Config::new().store(&store)).await;
}

async fn client_calendar_day(config: Config) {
    let backends = start_backends(&["b1"]).await;
    let base = config
        .route(Route::new("api").member(url(backends[0].local_addr())))
        .yaml();
    let yaml = format!(
        "{base}clients:
  list:
    - name: billing
      tokens: [\"{BILLING}\"]
      routes: [\"*\"]
      destinations: [\"*\"]
      quota: {{ windows: [{{ name: day, limit: 2, window: calendar_day }}] }}
    - name: search
      tokens: [\"search-token-0123456789\"]
      routes: [\"*\"]
      destinations: [\"*\"]
"
    );
    let (zone, offset) = noon_zone();
    let gw = Gateway::start_with_ports(&in_zone(&yaml, &zone));
    let mut client = HttpClient::connect(gw.proxy_addr()).await.unwrap();
    for _ in 0..2 {
        assert_eq!(
            get(&mut client, "api.test", Some(BILLING)).await.status,
            200
        );
    }
    let before = now_secs();
    let refused = get(&mut client, "api.test", Some(BILLING)).await;
    let after = now_secs();
    assert_eq!(refused.status, 429, "{}", refused.text());
    let detail = refused.json()["detail"].as_str().unwrap().to_string();
    assert!(
        detail.contains("billing") && detail.contains("day"),
        "{detail}"
    );
    waits_until(&refused, next_midnight(before, offset), before, after);
    let search = get(&mut client, "api.test", Some("search-token-0123456789")).await;
    assert_eq!(search.status, 200);
}

/// What the route `openai`'s token window holds now, from `/status`.
async fn tokens_held(gw: &Gateway) -> u64 {
    let status = gw.status().await;
    let route = status["routes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["name"] == "openai")
        .unwrap()
        .clone();
    let w = &route["quota"][0];
    let limit = w["limit"].as_u64().unwrap();
    limit - w["remaining"].as_u64().unwrap_or(limit)
}

/// A client's `{limit: 1, window: calendar_month, unit: usd}` on a route that prices dollars:
/// each request reserves $0.50 and settles $0.10 (10 tokens at $0.01). After five settled
/// requests the window holds exactly $0.50, so a sixth fits exactly at the limit ($0.50 +
/// $0.50), which it would not if any settlement were off by a millionth of a dollar or had
/// kept its reservation; the seventh ($0.60 + $0.50) is refused, naming the client's window.
/// A route that does not define `usd` charges the window nothing: it still admits then.
async fn a_clients_dollar_budget_settles_exactly_on_routes_that_price_dollars(backend: Backend) {
    let store = Store::start(backend);
    client_dollar_budget(Config::new().store(&store)).await;
}

async fn client_dollar_budget(config: Config) {
    let stub = OpenAiStub::start("stub", "127.0.0.1:0".parse().unwrap())
        .await
        .unwrap();
    let backends = start_backends(&["b1"]).await;
    let base = config
        .route(
            Route::new("openai")
                .hosts(&["openai.test"])
                .member(url(stub.local_addr())),
        )
        .route(Route::new("plain").member(url(backends[0].local_addr())))
        .yaml();
    let yaml = set(
        &base,
        &["routes", "0", "quota"],
        r#"
windows: [{ name: tpm, limit: 100000, window: 1m, unit: tokens }]
usage:
  tokens:
    reserve: { json: "max_tokens", default: 50 }
    settle: { json: "usage.total_tokens" }
  usd:
    reserve: { json: "max_tokens", default: 50, times: 0.01 }
    settle: { json: "usage.total_tokens", times: 0.01 }
"#,
    );
    let yaml = format!(
        "{yaml}clients:
  list:
    - name: billing
      tokens: [\"{BILLING}\"]
      routes: [\"*\"]
      destinations: [\"*\"]
      quota: {{ windows: [{{ name: month, limit: 1, window: calendar_month, unit: usd }}] }}
"
    );
    let gw = Gateway::start_with_ports(&in_zone(&yaml, &noon_zone().0));
    let auth = format!("Bearer {BILLING}");
    let body = json!({"model": "m", "max_tokens": 50, "messages": []}).to_string();
    let chat = || {
        let (addr, auth, body) = (gw.proxy_addr(), auth.clone(), body.clone());
        async move {
            let headers = [
                ("Content-Type", "application/json"),
                ("Proxy-Authorization", auth.as_str()),
                ("x-stub-prompt-tokens", "4"),
                ("x-stub-completion-tokens", "6"),
            ];
            request(
                addr,
                "POST",
                "openai.test",
                "/v1/chat/completions",
                &headers,
                body.as_bytes(),
            )
            .await
        }
    };
    for n in 1..=6u64 {
        // A request that finds the previous one's reservation not settled yet is refused, and
        // asks again: on a Redis Cluster the client's settlement is a call of its own, after
        // the route's. Were any settlement inexact or missing, the sixth would never fit.
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let r = chat().await;
            if r.status == 200 {
                break;
            }
            assert!(
                r.status == 429 && Instant::now() < deadline,
                "request {n}: {} {}",
                r.status,
                r.text()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let settled = wait_until_async(Duration::from_secs(20), || async {
            tokens_held(&gw).await == 10 * n
        })
        .await;
        assert!(settled, "request {n}: {} tokens", tokens_held(&gw).await);
    }
    let refused = chat().await;
    assert_eq!(refused.status, 429, "{}", refused.text());
    let detail = refused.json()["detail"].as_str().unwrap().to_string();
    assert!(
        detail.contains("billing") && detail.contains("month"),
        "{detail}"
    );
    assert_eq!(
        stub.exchanges().len(),
        6,
        "a refused request reaches no member"
    );
    // `/status` shows the budget in dollars: $0.60 of $1 used, $0.40 left, read as 0 (what is
    // left is rounded down to a whole unit).
    let status = gw.status().await;
    let month = &status["clients"]["list"][0]["quota"][0];
    assert_eq!(month["unit"], "usd", "{month}");
    assert_eq!(month["limit"], 1, "{month}");
    assert_eq!(month["remaining"], 0, "{month}");
    // A calendar window's length is its current period's: a month of 28 to 31 days.
    let days = month["window_ms"].as_u64().unwrap_or(0) / 86_400_000;
    assert!((28..=31).contains(&days), "{month}");
    // What it holds shows apart, exact: $0.60 settled and nothing reserved, once the client's
    // own settlement (a call of its own on a cluster) is in.
    let apart = wait_until_async(Duration::from_secs(20), || async {
        let status = gw.status().await;
        let month = &status["clients"]["list"][0]["quota"][0];
        month["reserved"] == 0 && month["settled"].as_f64() == Some(0.6)
    })
    .await;
    let status = gw.status().await;
    assert!(apart, "{}", status["clients"]["list"][0]["quota"][0]);
    let mut client = HttpClient::connect(gw.proxy_addr()).await.unwrap();
    for _ in 0..3 {
        let r = get(&mut client, "plain.test", Some(BILLING)).await;
        assert_eq!(
            r.status,
            200,
            "a route without usd charges nothing: {}",
            r.text()
        );
    }
}

/// On a Redis Cluster, where a client's windows live in a slot of their own: the route's,
/// the members' and the client's calendar windows refuse until their boundaries, and the
/// client's dollar budget settles exactly.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_a_cluster_calendar_and_dollar_windows_hold() {
    let cluster = RedisCluster::start();
    let config = || Config::new().state(State::cluster(cluster.urls()));
    route_calendar_day(config()).await;
    member_calendar_day(config()).await;
    client_calendar_day(config()).await;
    client_dollar_budget(config()).await;
}

/// What member `i` of the first route holds in its first window, from `/status`: reserved and
/// settled requests.
async fn member_holds(gw: &Gateway, i: usize) -> (u64, u64) {
    let status = gw.status().await;
    let w = &status["routes"][0]["members"][i]["quota"][0];
    (
        w["reserved"].as_u64().unwrap_or(u64::MAX),
        w["settled"].as_u64().unwrap_or(u64::MAX),
    )
}

/// A request whose first member (`k1`, nothing listening) fails to connect is retried on
/// `k2`: both keys' calendar windows hold the request, in the admission's period, and its
/// settlement closes both entries, the retry's too: nothing is left reserved.
async fn a_retry_charges_the_next_members_calendar_window_and_settles_it(backend: Backend) {
    let store = Store::start(backend);
    let backends = start_backends(&["b2"]).await;
    let nobody = support::dead_url();
    let route = Route::new("api")
        .priority()
        .retries(1)
        // Never ejected, so that each request tries k1 first.
        .passive(Passive::cooldown("1h").fall(100))
        .key_member(KeyMember::new(nobody, "k1").window("day", 100, "calendar_day"))
        .key_member(KeyMember::new(url(backends[0].local_addr()), "k2").window(
            "day",
            5,
            "calendar_day",
        ));
    let yaml = Config::new().store(&store).route(route).yaml();
    let gw = Gateway::start_with_ports(&in_zone(&yaml, &noon_zone().0));
    let mut client = HttpClient::connect(gw.proxy_addr()).await.unwrap();
    for _ in 0..2 {
        let r = get(&mut client, "api.test", None).await;
        assert_eq!(r.status, 200, "{}", r.text());
    }
    assert_eq!(backends[0].proxied_requests(), 2);
    for i in [0, 1] {
        let settled = wait_until_async(Duration::from_secs(20), || async {
            member_holds(&gw, i).await == (0, 2)
        })
        .await;
        assert!(settled, "member {i}: {:?}", member_holds(&gw, i).await);
    }
}
