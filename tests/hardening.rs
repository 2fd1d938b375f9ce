//! Defects an adversarial run found (issue 11), each pinned end to end.

mod support;

use std::net::SocketAddr;

use support::{request, start_backends, Gateway, HttpClient};

fn url(addr: SocketAddr) -> String {
    format!("http://{addr}")
}

/// A cost rule `path_prefix: /v1/search, cost: 100` once charged `/v1//search` (and three other
/// spellings of the same resource) at cost 1, while the member served the expensive endpoint.
/// Every spelling is now charged as `/v1/search`, and the member is sent that path.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_spelling_of_a_path_is_charged_as_what_is_served() {
    let backends = start_backends(&["api"]).await;
    let gw = Gateway::start_with_ports(&format!(
        "listen: [\"{{PROXY}}\"]\nadmin:\n  listen: \"{{ADMIN}}\"\nthreads: 1\nroutes:\n  - name: api\n    match:\n      hosts: [\"api.test\"]\n    upstream:\n      members:\n        - url: \"{}\"\n    quota:\n      windows:\n        - {{ name: hour, limit: 1000, window: 1h }}\n      cost:\n        rules:\n          - {{ path_prefix: \"/v1/search\", cost: 100 }}\n",
        url(backends[0].local_addr())
    ));
    let spellings = [
        "/v1/search",
        "/v1//search",
        "/v1/./search",
        "/v1/%73earch",
        "/v1/x/../search",
        "//v1/search?q=1",
        "/v1/%2e/search",
        "/v1/search/../search",
    ];
    let mut client = HttpClient::connect(gw.proxy_addr()).await.unwrap();
    let mut admitted = 0;
    for i in 0..20 {
        let path = spellings[i % spellings.len()];
        let r = client
            .request("GET", "api.test", path, &[], b"")
            .await
            .unwrap();
        match r.status {
            200 => {
                admitted += 1;
                assert!(
                    r.json()["target"]
                        .as_str()
                        .unwrap()
                        .starts_with("/v1/search"),
                    "{path} reached the member as {}",
                    r.json()["target"]
                );
            }
            429 => assert_eq!(r.header("x-sluice-error"), Some("quota_exceeded")),
            other => panic!("{path}: status {other}"),
        }
    }
    assert_eq!(admitted, 10, "1000 units at cost 100");
    assert_eq!(backends[0].proxied_requests(), 10);
}

/// What cannot be normalized without guessing is refused with 400 and its own code, and no
/// member is contacted. So are schemes sluice does not carry, a missing Host, and an `https://`
/// target that would reach an http member in cleartext.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn targets_that_cannot_be_routed_safely_get_400() {
    let backends = start_backends(&["api"]).await;
    let gw = Gateway::start_with_ports(&format!(
        "listen: [\"{{PROXY}}\"]\nadmin:\n  listen: \"{{ADMIN}}\"\nthreads: 1\nroutes:\n  - name: any\n    upstream:\n      members:\n        - url: \"{}\"\n",
        url(backends[0].local_addr())
    ));
    let cases: [(&str, &str); 7] = [
        (
            "GET /../etc/passwd HTTP/1.1\r\nHost: api.test\r\n\r\n",
            "bad_path",
        ),
        ("GET /a%2Fb HTTP/1.1\r\nHost: api.test\r\n\r\n", "bad_path"),
        ("GET /a%00b HTTP/1.1\r\nHost: api.test\r\n\r\n", "bad_path"),
        ("GET /a%zz HTTP/1.1\r\nHost: api.test\r\n\r\n", "bad_path"),
        ("GET / HTTP/1.1\r\n\r\n", "missing_host"),
        (
            "GET ftp://api.test/x HTTP/1.1\r\nHost: api.test\r\n\r\n",
            "unsupported_scheme",
        ),
        (
            "GET https://api.test/x HTTP/1.1\r\nHost: api.test\r\n\r\n",
            "https_in_cleartext",
        ),
    ];
    for (raw, code) in cases {
        let mut client = HttpClient::connect(gw.proxy_addr()).await.unwrap();
        client.write_raw(raw.as_bytes()).await.unwrap();
        let r = client.read_response(false).await.unwrap();
        assert_eq!(
            (r.status, r.header("x-sluice-error")),
            (400, Some(code)),
            "{raw:?}"
        );
    }
    assert_eq!(backends[0].requests(), 0);
    // A plain request still goes through.
    assert_eq!(
        request(gw.proxy_addr(), "GET", "api.test", "/ok", &[], b"")
            .await
            .status,
        200
    );
}

/// `key: header:X-Tenant` with 4 KB values once grew the stores by ~3 KB per distinct value
/// (Redis key names as long as the value). Long values are now hashed into a fixed-size key:
/// the same value still counts against one key, different values against different keys.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn long_quota_key_values_are_hashed_into_short_keys() {
    let redis = sluice_testkit::RedisServer::start();
    let backends = start_backends(&["api"]).await;
    let gw = Gateway::start_with_ports(&format!(
        "listen: [\"{{PROXY}}\"]\nadmin:\n  listen: \"{{ADMIN}}\"\nthreads: 1\nstate:\n  backend: redis\n  redis:\n    url: \"{}\"\n    timeout: 5s\nroutes:\n  - name: api\n    match:\n      hosts: [\"api.test\"]\n    upstream:\n      members:\n        - url: \"{}\"\n    quota:\n      key: header:X-Tenant\n      windows:\n        - {{ name: hour, limit: 1, window: 1h }}\n",
        redis.url(),
        url(backends[0].local_addr())
    ));
    let tenant = |c: char| c.to_string().repeat(4096);
    let mut client = HttpClient::connect(gw.proxy_addr()).await.unwrap();
    for (value, expect) in [(tenant('a'), 200), (tenant('a'), 429), (tenant('b'), 200)] {
        let r = client
            .request("GET", "api.test", "/", &[("x-tenant", &value)], b"")
            .await
            .unwrap();
        assert_eq!(r.status, expect);
    }
    let keys = redis.command(&["KEYS", "*"]).unwrap();
    let names: Vec<&str> = keys.lines().filter(|l| !l.is_empty()).collect();
    assert!(names.len() >= 2, "{names:?}");
    assert!(
        names.iter().all(|k| k.len() < 128),
        "key names stay short: {:?}",
        names.iter().map(|k| k.len()).collect::<Vec<_>>()
    );
}
