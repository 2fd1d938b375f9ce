//! End-to-end proxying through the real `sluice` binary to real backends on 127.0.0.1:
//! round-robin, both request forms, header handling, gateway-made answers, retries and metrics.

mod support;

use std::sync::atomic::Ordering;
use std::time::Duration;

use support::{
    dead_url, request, start_backends, url, Config, Gateway, HttpClient, Passive, Route,
};

/// A gateway with one route `api` on host `api.test`.
fn start(route: Route) -> Gateway {
    Config::new().route(route).start()
}

/// The route `api` over `members`.
fn api(members: &[String]) -> Route {
    Route::new("api").members(members)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn round_robin_spreads_requests_evenly_across_three_backends() {
    let backends = start_backends(&["b1", "b2", "b3"]).await;
    let members: Vec<String> = backends.iter().map(|b| url(b.local_addr())).collect();
    let gw = start(api(&members));

    let mut client = HttpClient::connect(gw.proxy_addr()).await.unwrap();
    for _ in 0..300 {
        let r = client
            .request("GET", "api.test", "/x", &[], b"")
            .await
            .unwrap();
        assert_eq!(r.status, 200);
    }
    let counts: Vec<u64> = backends.iter().map(|b| b.proxied_requests()).collect();
    assert_eq!(
        counts,
        [100, 100, 100],
        "each backend counts its own requests"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn weights_share_requests_in_proportion() {
    let backends = start_backends(&["heavy", "light"]).await;
    let gw = start(
        Route::new("api")
            .weighted_member(url(backends[0].local_addr()), 3)
            .weighted_member(url(backends[1].local_addr()), 1),
    );
    let mut client = HttpClient::connect(gw.proxy_addr()).await.unwrap();
    for _ in 0..400 {
        assert_eq!(
            client
                .request("GET", "api.test", "/", &[], b"")
                .await
                .unwrap()
                .status,
            200
        );
    }
    assert_eq!(backends[0].proxied_requests(), 300);
    assert_eq!(backends[1].proxied_requests(), 100);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forward_proxy_form_and_gateway_form_route_alike() {
    let backends = start_backends(&["b1"]).await;
    let gw = start(api(&[url(backends[0].local_addr())]));

    // What `curl -x http://sluice http://api.test/v1/items?q=1` sends.
    let mut client = HttpClient::connect(gw.proxy_addr()).await.unwrap();
    let forward = client
        .send(
            "GET http://api.test/v1/items?q=1 HTTP/1.1\r\nHost: api.test\r\nUser-Agent: curl/7.88.1\r\nAccept: */*\r\nProxy-Connection: Keep-Alive\r\n\r\n",
            b"",
        )
        .await
        .unwrap();
    assert_eq!(forward.status, 200, "{}", forward.text());
    let seen = forward.json();
    assert_eq!(
        seen["target"], "/v1/items?q=1",
        "members get origin-form targets"
    );
    assert_eq!(seen["headers"]["host"], "api.test");
    assert!(seen["headers"].get("proxy-connection").is_none());

    let gateway = request(
        gw.proxy_addr(),
        "GET",
        "api.test",
        "/v1/items?q=1",
        &[],
        b"",
    )
    .await;
    assert_eq!(gateway.status, 200);
    assert_eq!(gateway.json()["target"], "/v1/items?q=1");
    assert_eq!(gateway.json()["headers"]["host"], "api.test");

    // An absolute URI for an unknown host is not routed by its Host header.
    let unknown = client
        .send(
            "GET http://other.test/ HTTP/1.1\r\nHost: other.test\r\n\r\n",
            b"",
        )
        .await
        .unwrap();
    assert_eq!(unknown.status, 404);
    assert_eq!(backends[0].proxied_requests(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forward_proxy_form_works_with_real_curl() {
    let backends = start_backends(&["b1"]).await;
    let gw = start(api(&[url(backends[0].local_addr())]));
    let proxy = format!("http://{}", gw.proxy_addr());
    let out = tokio::task::spawn_blocking(move || {
        std::process::Command::new("curl")
            .args([
                "-sS",
                "--max-time",
                "10",
                "-x",
                &proxy,
                "http://api.test/from-curl",
            ])
            .output()
            .expect("curl is installed")
    })
    .await
    .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let body: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(body["target"], "/from-curl");
    assert_eq!(body["upstream"], "b1");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn headers_are_fixed_up_on_the_way() {
    let backends = start_backends(&["b1"]).await;
    let member = backends[0].local_addr();
    let gw = start(api(&[url(member)]).preserve_host(false));

    let r = request(
        gw.proxy_addr(),
        "GET",
        "api.test",
        "/h",
        &[
            ("X-Forwarded-For", "10.1.2.3"),
            ("Connection", "keep-alive, x-private"),
            ("X-Private", "secret"),
            ("Keep-Alive", "timeout=5"),
            ("Proxy-Authorization", "Basic c2VjcmV0"),
            ("TE", "trailers"),
            ("proxy-CONNECTION", "keep-alive"),
            ("Proxy-Authenticate", "Basic"),
            ("Upgrade", "h2c"),
            ("HTTP2-Settings", "AAMAAABkAARAAAAAAAIAAAAA"),
            ("X-Kept", "yes"),
        ],
        b"",
    )
    .await;
    assert_eq!(r.status, 200);
    let h = &r.json()["headers"];
    assert_eq!(
        h["host"],
        member.to_string(),
        "preserve_host: false sends the member's authority"
    );
    assert_eq!(h["x-forwarded-for"], "10.1.2.3, 127.0.0.1");
    // Pingora removes the standard ones present before sluice's hooks run
    // (third_party/PATCHES.md, "hop-by-hop walk"), and sluice again after them.
    for gone in [
        "x-private",
        "keep-alive",
        "proxy-authorization",
        "te",
        "connection",
        "proxy-connection",
        "proxy-authenticate",
        "upgrade",
        "http2-settings",
    ] {
        assert!(
            h.get(gone).is_none(),
            "{gone} must not reach the member: {h}"
        );
    }
    assert_eq!(h["x-kept"], "yes");
}

/// A member on loopback that hands over each raw request head it receives (requests without a
/// body) and answers every request on a connection with `answer`, keeping the connection.
async fn raw_member(
    answer: &'static str,
) -> (
    std::net::SocketAddr,
    tokio::sync::mpsc::UnboundedReceiver<String>,
) {
    raw_member_with(move |_| (answer.as_bytes(), false)).await
}

/// [raw_member] with the answer chosen by `answer` from each head: its bytes, and whether the
/// member closes the connection after them.
async fn raw_member_with(
    answer: impl Fn(&str) -> (&'static [u8], bool) + Clone + Send + 'static,
) -> (
    std::net::SocketAddr,
    tokio::sync::mpsc::UnboundedReceiver<String>,
) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let member = listener.local_addr().unwrap();
    let (heads, received) = tokio::sync::mpsc::unbounded_channel::<String>();
    tokio::spawn(async move {
        while let Ok((mut conn, _)) = listener.accept().await {
            let (heads, answer) = (heads.clone(), answer.clone());
            tokio::spawn(async move {
                let mut read = Vec::new();
                let mut buf = [0u8; 4096];
                loop {
                    while !read.windows(4).any(|w| w == b"\r\n\r\n") {
                        match conn.read(&mut buf).await {
                            Ok(n) if n > 0 => read.extend_from_slice(&buf[..n]),
                            _ => return,
                        }
                    }
                    let end = read.windows(4).position(|w| w == b"\r\n\r\n").unwrap() + 4;
                    let head: Vec<u8> = read.drain(..end).collect();
                    let head = String::from_utf8_lossy(&head).into_owned();
                    let (bytes, close) = answer(&head);
                    let _ = heads.send(head);
                    if conn.write_all(bytes).await.is_err() || close {
                        return;
                    }
                }
            });
        }
    });
    (member, received)
}

/// The next head `raw_member` received, within 10 s.
async fn next_head(received: &mut tokio::sync::mpsc::UnboundedReceiver<String>) -> String {
    tokio::time::timeout(Duration::from_secs(10), received.recv())
        .await
        .expect("the member got the request")
        .unwrap()
}

/// One answer read off a raw client connection: the head and its `Content-Length` body, as
/// text. Fails if the connection closes first or nothing whole comes within 10 s.
async fn read_answer(client: &mut tokio::net::TcpStream) -> String {
    use tokio::io::AsyncReadExt;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    let mut answer = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        if let Some(end) = answer.windows(4).position(|w| w == b"\r\n\r\n") {
            let head = String::from_utf8_lossy(&answer[..end]).to_ascii_lowercase();
            let length = head
                .lines()
                .find_map(|l| l.strip_prefix("content-length:"))
                .map_or(0, |v| v.trim().parse::<usize>().unwrap());
            if answer.len() >= end + 4 + length {
                return String::from_utf8(answer).unwrap();
            }
        }
        let n = tokio::time::timeout_at(deadline, client.read(&mut buf))
            .await
            .expect("an answer within 10 s")
            .unwrap();
        assert!(n > 0, "closed early: {}", String::from_utf8_lossy(&answer));
        answer.extend_from_slice(&buf[..n]);
    }
}

/// A head's lines, the request or status line first.
fn lines(head: &str) -> Vec<String> {
    head.split("\r\n").map(str::to_string).collect()
}

/// The values of the field `name` (any case) among `lines`.
fn field_values<'a>(lines: &'a [String], name: &str) -> Vec<&'a str> {
    lines
        .iter()
        .filter_map(|l| l.split_once(':'))
        .filter(|(n, _)| n.eq_ignore_ascii_case(name))
        .map(|(_, v)| v.trim())
        .collect()
}

/// Header names keep the case they were written in, on the wire both ways: the client's and
/// the member's as sent, the headers sluice adds as sluice writes them (`x-request-id`,
/// `x-forwarded-for`, `traceparent` in lowercase; `Host` titled). Pingora keeps a case map
/// beside each header map; sluice inserts its names prebuilt (third_party/PATCHES.md,
/// pingora-http), and this pins that the bytes on the wire did not change with it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn header_names_keep_their_case_on_the_wire_both_ways() {
    use tokio::io::AsyncWriteExt;
    use tokio::net::TcpStream;

    // A member that hands over the raw head it received and answers with mixed-case names.
    let (member, mut received) = raw_member(
        "HTTP/1.1 200 OK\r\nX-Member-Case: Kept\r\nSERVER: raw\r\ncontent-LENGTH: 2\r\n\r\nok",
    )
    .await;
    let gw = start(api(&[url(member)]).preserve_host(false));

    let trace_id = "4bf92f3577b34da6a3ce929d0e0e4736";
    let mut client = TcpStream::connect(gw.proxy_addr()).await.unwrap();
    let ask = format!(
        "GET /case HTTP/1.1\r\nHost: api.test\r\nX-Client-Case: Mixed\r\n\
         X-FORWARDED-FOR: 10.1.2.3\r\nx-request-id: case-id-1\r\n\
         traceparent: 00-{trace_id}-00f067aa0ba902b7-01\r\n\r\n"
    );
    client.write_all(ask.as_bytes()).await.unwrap();
    let answer = read_answer(&mut client).await;
    let head = next_head(&mut received).await;

    let sent = lines(&head);
    let has = |lines: &[String], line: &str| lines.iter().any(|l| l == line);
    assert!(has(&sent, "X-Client-Case: Mixed"), "{head}");
    assert!(has(&sent, &format!("Host: {member}")), "{head}");
    // The client's field is replaced by the list with its address appended, under
    // sluice's own spelling.
    assert!(has(&sent, "x-forwarded-for: 10.1.2.3, 127.0.0.1"), "{head}");
    assert!(has(&sent, "x-request-id: case-id-1"), "{head}");
    let traceparent = sent
        .iter()
        .find(|l| l.starts_with("traceparent: "))
        .unwrap_or_else(|| panic!("no traceparent: {head}"));
    assert!(
        traceparent.starts_with(&format!("traceparent: 00-{trace_id}-")),
        "{head}"
    );
    assert!(
        !sent.iter().any(|l| l.starts_with("X-FORWARDED-FOR")),
        "{head}"
    );

    let got = lines(&answer);
    assert!(got[0].starts_with("HTTP/1.1 200"), "{answer}");
    assert!(has(&got, "X-Member-Case: Kept"), "{answer}");
    assert!(has(&got, "SERVER: raw"), "{answer}");
    assert!(has(&got, "content-LENGTH: 2"), "{answer}");
    assert!(has(&got, "x-request-id: case-id-1"), "{answer}");
}

/// Every answer carries exactly one `Date`, the gateway's (a valid, current IMF-fixdate that
/// follows the clock, not the member's), and a `Connection` that tells the client what
/// happens to its connection: `keep-alive` while it is kept, `close` on the answer after
/// which the gateway closes it. Pingora writes both into every response head; the value of
/// `Connection` is a static one rather than a string parsed and copied per response
/// (third_party/PATCHES.md, "static Connection values").
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn answers_carry_one_current_date_and_the_connection_state() {
    use std::time::{SystemTime, UNIX_EPOCH};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    let (member, _received) = raw_member(
        "HTTP/1.1 200 OK\r\nDate: Thu, 01 Jan 1970 00:00:00 GMT\r\nConnection: keep-alive\r\n\
         Content-Length: 2\r\n\r\nok",
    )
    .await;
    let gw = start(api(&[url(member)]));
    let secs = |t: SystemTime| t.duration_since(UNIX_EPOCH).unwrap().as_secs();
    // One connection throughout, shared with the polling closure below.
    let client = tokio::sync::Mutex::new(
        tokio::net::TcpStream::connect(gw.proxy_addr())
            .await
            .unwrap(),
    );
    // One request on the kept connection: its answer's `Date`, checked.
    let ask = |connection: &'static str| {
        let client = &client;
        async move {
            let mut client = client.lock().await;
            let before = secs(SystemTime::now());
            let ask = format!("GET /d HTTP/1.1\r\nHost: api.test\r\n{connection}\r\n");
            client.write_all(ask.as_bytes()).await.unwrap();
            let answer = read_answer(&mut client).await;
            let after = secs(SystemTime::now());
            let got = lines(&answer);
            assert!(got[0].starts_with("HTTP/1.1 200"), "{answer}");
            let dates = field_values(&got, "date");
            assert_eq!(dates.len(), 1, "one Date: {answer}");
            let date = httpdate::parse_http_date(dates[0])
                .unwrap_or_else(|e| panic!("not an HTTP date ({e}): {answer}"));
            // IMF-fixdate is the form an HTTP date is sent in (RFC 9110 §5.6.7).
            assert_eq!(httpdate::fmt_http_date(date), dates[0], "{answer}");
            assert!(
                (before..=after).contains(&secs(date)),
                "a current Date, not the member's: {answer}"
            );
            assert_eq!(
                field_values(&got, "connection"),
                [if connection.is_empty() {
                    "keep-alive"
                } else {
                    "close"
                }],
                "{got:?}"
            );
            dates[0].to_string()
        }
    };

    let first = ask("").await;
    // The gateway's date follows the clock: ask on the same connection until it moves on.
    let moved_on =
        support::wait_until_async(Duration::from_secs(20), || async { ask("").await != first })
            .await;
    assert!(moved_on, "Date stayed {first} for 10 s");

    ask("Connection: close\r\n").await;
    let mut rest = [0u8; 64];
    let closed = tokio::time::timeout(Duration::from_secs(10), client.lock().await.read(&mut rest))
        .await
        .expect("the gateway closes the connection after Connection: close");
    assert_eq!(closed.unwrap(), 0, "nothing follows the last answer");
}

/// The head sent to the member is the client's with sluice's headers added, and the answer the
/// member's: small heads and large ones, with repeated names, arrive whole, in order (the values
/// of a name together) and in the case they were written in, whatever the number of headers
/// added. Pingora parses both heads with room for the headers a proxy adds and hands them on as
/// parsed (third_party/PATCHES.md, "request head handed upstream with room", "response head
/// handed out with room"); the member here adds nine headers of its own, more than that room.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn heads_small_and_large_reach_the_member_and_the_client_whole() {
    use tokio::io::AsyncWriteExt;

    // Pingora's maps keep the values of a name together, in the order they came: the fields
    // as the client receives them, in that order. The large answer has 16 more.
    let small_fields = [
        "Server: raw",
        "Set-Cookie: a=1",
        "set-cookie: b=2",
        "X-Answer: One",
    ];
    let large_fields: Vec<String> = small_fields
        .iter()
        .map(|f| f.to_string())
        .chain((0..16).map(|i| format!("X-Extra-{i}: e{i}")))
        .collect();
    let answer_with = |fields: &[String]| -> &'static [u8] {
        // The set-cookie fields apart, to be put back together.
        let (cookie, rest) = (&fields[2], [&fields[..2], &fields[3..]].concat());
        let head: String = rest.iter().map(|f| format!("{f}\r\n")).collect();
        let answer = format!(
            "HTTP/1.1 200 OK\r\nDate: Thu, 01 Jan 1970 00:00:00 GMT\r\n{head}{cookie}\r\n\
             Connection: keep-alive\r\ncontent-length: 2\r\n\r\nok"
        );
        Box::leak(answer.into_boxed_str()).as_bytes()
    };
    let small_answer = answer_with(&small_fields.map(String::from));
    let large_answer = answer_with(&large_fields);
    let (member, mut received) = raw_member_with(move |head| {
        let large = head.starts_with("GET /large ");
        (if large { large_answer } else { small_answer }, false)
    })
    .await;
    let added: Vec<(String, String)> = (1..=9)
        .map(|i| (format!("X-Member-{i}"), format!("m{i}")))
        .collect();
    let key = added.iter().fold(
        support::KeyMember::new(url(member), "key"),
        |key, (name, value)| key.header(name, value),
    );
    let gw = start(Route::new("api").key_member(key).preserve_host(false));

    let large: Vec<String> = (0..12)
        .map(|i| format!("X-Client-{}: c{i}", i / 3))
        .chain(["accept: */*".to_string(), "X-Member-1: client".to_string()])
        .collect();
    let mut client = tokio::net::TcpStream::connect(gw.proxy_addr())
        .await
        .unwrap();
    let small_fields = small_fields.map(String::from).to_vec();
    for (path, client_headers, member_fields) in [
        ("/small", Vec::new(), small_fields),
        ("/large", large, large_fields),
    ] {
        let ask = format!(
            "GET {path} HTTP/1.1\r\nHost: api.test\r\n{}\r\n",
            client_headers
                .iter()
                .map(|h| format!("{h}\r\n"))
                .collect::<String>()
        );
        client.write_all(ask.as_bytes()).await.unwrap();
        let answer = read_answer(&mut client).await;
        let head = next_head(&mut received).await;

        let sent = lines(&head);
        // The client's headers in their order and case, but the one the member replaces.
        let kept: Vec<&String> = client_headers
            .iter()
            .filter(|h| !h.starts_with("X-Member-1:"))
            .collect();
        let forwarded: Vec<&String> = sent.iter().filter(|l| kept.contains(l)).collect();
        assert_eq!(forwarded, kept, "{head}");
        assert_eq!(field_values(&sent, "host"), [member.to_string()], "{head}");
        for (name, value) in &added {
            assert_eq!(field_values(&sent, name), [value.as_str()], "{head}");
        }
        assert_eq!(
            field_values(&sent, "x-forwarded-for"),
            ["127.0.0.1"],
            "{head}"
        );
        assert_eq!(field_values(&sent, "x-request-id").len(), 1, "{head}");

        let got = lines(&answer);
        assert!(got[0].starts_with("HTTP/1.1 200"), "{answer}");
        let relayed: Vec<String> = got
            .iter()
            .filter(|l| member_fields.contains(l))
            .cloned()
            .collect();
        assert_eq!(relayed, member_fields, "{answer}");
        // The Date field itself: the random request id elsewhere in the answer may hold "1970".
        let date = field_values(&got, "date");
        assert_eq!(date.len(), 1, "{answer}");
        assert!(!date[0].contains("1970"), "the gateway's Date: {answer}");
        assert_eq!(field_values(&got, "connection"), ["keep-alive"], "{answer}");
        assert_eq!(
            field_values(&got, "x-request-id"),
            field_values(&sent, "x-request-id"),
            "{answer}"
        );
        assert!(answer.ends_with("\r\n\r\nok"), "{answer}");
    }
}

/// An answer keeps the member's framing when it has one (a `Content-Length`, or chunks), and one
/// whose end is the member closing its connection reaches the client in chunks, so that the
/// client's connection is kept. Pingora decides this by looking up both framing fields of every
/// answer, `Content-Length` first (third_party/PATCHES.md, "framing lookups first by
/// likelihood").
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn answers_keep_their_framing_or_are_chunked_when_the_member_closes() {
    // A body ended by the member closing its connection: `/close`.
    let (member, _received) = raw_member_with(|head| match head.split(' ').nth(1) {
        Some("/chunked") => (
            &b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n"[..],
            false,
        ),
        Some("/close") => (
            &b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\nhello"[..],
            true,
        ),
        _ => (
            &b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello"[..],
            false,
        ),
    })
    .await;
    let gw = start(api(&[url(member)]));

    let mut client = HttpClient::connect(gw.proxy_addr()).await.unwrap();
    for (path, framing) in [
        ("/length", "length"),
        ("/chunked", "chunked"),
        ("/close", "chunked"),
        ("/length", "length"),
    ] {
        let r = client
            .request("GET", "api.test", path, &[], b"")
            .await
            .unwrap_or_else(|e| panic!("{path}: {e}"));
        assert_eq!((r.status, &r.body[..]), (200, &b"hello"[..]), "{path}");
        assert_eq!(r.header("connection"), Some("keep-alive"), "{path}");
        let (length, chunked) = match framing {
            "length" => (Some("5"), None),
            _ => (None, Some("chunked")),
        };
        assert_eq!(r.header("content-length"), length, "{path}: {r:?}");
        assert_eq!(r.header("transfer-encoding"), chunked, "{path}: {r:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unknown_host_gets_a_404_problem_and_no_member_is_contacted() {
    let backends = start_backends(&["b1"]).await;
    let gw = start(api(&[url(backends[0].local_addr())]));
    let r = request(gw.proxy_addr(), "GET", "nope.test", "/x", &[], b"").await;
    assert_eq!(r.status, 404);
    assert_eq!(r.header("content-type"), Some("application/problem+json"));
    assert_eq!(r.header("x-sluice-error"), Some("no_route"));
    let body = r.json();
    assert_eq!(body["status"], 404);
    assert_eq!(body["type"], "urn:sluice:error:no_route");
    assert!(body["title"].is_string() && body["detail"].is_string());
    assert!(body["route"].is_null());
    // A path outside every prefix and a method outside every list are unknown routes too.
    assert_eq!(backends[0].requests(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connect_is_answered_405_with_allow_where_it_cannot_tunnel() {
    let backends = start_backends(&["b1"]).await;
    let member = url(backends[0].local_addr());
    let gw = Config::new()
        .route(api(std::slice::from_ref(&member)).methods(&["GET", "POST"]))
        .route(Route::new("open").member(member.clone()))
        .start();
    // A route whose methods leave CONNECT out.
    let mut client = HttpClient::connect(gw.proxy_addr()).await.unwrap();
    client
        .write_raw(b"CONNECT api.test:443 HTTP/1.1\r\nHost: api.test:443\r\n\r\n")
        .await
        .unwrap();
    let r = client.read_response(false).await.unwrap();
    assert_eq!(r.status, 405);
    assert_eq!(r.header("x-sluice-error"), Some("method_not_allowed"));
    assert_eq!(r.header("allow"), Some("GET, POST"));
    assert_eq!(r.json()["status"], 405);

    // A CONNECT after a request on a kept-alive connection: Pingora owns the connection by
    // then, so it cannot become a tunnel (see crate::tunnel).
    let mut client = HttpClient::connect(gw.proxy_addr()).await.unwrap();
    let r = client
        .request("GET", "open.test", "/", &[], b"")
        .await
        .unwrap();
    assert_eq!(r.status, 200);
    client
        .write_raw(b"CONNECT open.test:443 HTTP/1.1\r\nHost: open.test:443\r\n\r\n")
        .await
        .unwrap();
    let r = client.read_response(false).await.unwrap();
    assert_eq!(r.status, 405);
    assert_eq!(r.header("x-sluice-error"), Some("method_not_allowed"));
    assert!(r.header("allow").is_some_and(|a| a.contains("GET")));
    assert_eq!(backends[0].proxied_requests(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connect_failures_are_retried_on_other_members_for_every_method() {
    let backends = start_backends(&["alive"]).await;
    let dead = dead_url();
    let members = [dead.clone(), url(backends[0].local_addr())];
    let gw = start(api(&members).retries(2));

    for i in 0..20 {
        let method = if i % 2 == 0 { "POST" } else { "GET" };
        let r = request(gw.proxy_addr(), method, "api.test", "/r", &[], b"payload").await;
        assert_eq!(r.status, 200, "{method} #{i}: {}", r.text());
        assert_eq!(r.json()["upstream"], "alive");
    }
    assert_eq!(backends[0].proxied_requests(), 20);
    let m = gw.metrics().await;
    let failures = support::metric_value(
        &m,
        "sluice_upstream_attempts_total",
        &[("member", &dead), ("outcome", "connect_failure")],
    );
    assert_eq!(
        failures,
        Some(1.0),
        "passive fall 1 ejects the dead member at once"
    );
    assert_eq!(
        support::metric_value(&m, "sluice_member_healthy", &[("member", &dead)]),
        Some(0.0)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_that_reached_a_member_is_never_replayed() {
    let backends = start_backends(&["good"]).await;
    let (crasher, crashed) = support::start_hang_up_member().await;
    let members = [url(crasher), url(backends[0].local_addr())];
    let gw = start(api(&members).retries(3));

    let (mut ok, mut failed) = (0, 0);
    for i in 0..20 {
        let method = if i % 2 == 0 { "POST" } else { "GET" };
        let r = request(
            gw.proxy_addr(),
            method,
            "api.test",
            "/pay",
            &[],
            b"charge=1",
        )
        .await;
        match r.status {
            200 => ok += 1,
            502 => {
                assert_eq!(r.header("x-sluice-error"), Some("upstream_error"));
                failed += 1;
            }
            s => panic!("unexpected status {s}: {}", r.text()),
        }
    }
    assert!(
        failed > 0,
        "round-robin must have sent some requests to the crashing member"
    );
    assert_eq!(
        crashed.load(Ordering::SeqCst),
        failed,
        "each 502 is one request the crasher got"
    );
    assert_eq!(
        backends[0].proxied_requests(),
        ok,
        "no request was replayed to the good member"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn all_members_down_gives_502_after_attempts_then_503() {
    let members = [dead_url(), dead_url()];
    let gw = start(
        api(&members)
            .retries(2)
            .passive(Passive::cooldown("1h").fall(1)),
    );
    let first = request(gw.proxy_addr(), "GET", "api.test", "/", &[], b"").await;
    assert_eq!(first.status, 502, "{}", first.text());
    assert_eq!(first.header("x-sluice-error"), Some("upstream_unreachable"));
    assert_eq!(first.json()["route"], "api");

    let second = request(gw.proxy_addr(), "GET", "api.test", "/", &[], b"").await;
    assert_eq!(second.status, 503);
    assert_eq!(second.header("x-sluice-error"), Some("no_member"));
    assert_eq!(
        second.header("content-type"),
        Some("application/problem+json")
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_empty_pool_answers_503_no_member() {
    let gw = start(api(&[]));
    let r = request(gw.proxy_addr(), "GET", "api.test", "/", &[], b"").await;
    assert_eq!(r.status, 503);
    assert_eq!(r.header("x-sluice-error"), Some("no_member"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_agree_with_the_requests_sent() {
    let backends = start_backends(&["b1", "b2"]).await;
    let members: Vec<String> = backends.iter().map(|b| url(b.local_addr())).collect();
    let gw = start(api(&members));
    let mut client = HttpClient::connect(gw.proxy_addr()).await.unwrap();
    for _ in 0..25 {
        assert_eq!(
            client
                .request("GET", "api.test", "/m", &[], b"")
                .await
                .unwrap()
                .status,
            200
        );
    }
    for _ in 0..7 {
        assert_eq!(
            client
                .request("GET", "nope.test", "/m", &[], b"")
                .await
                .unwrap()
                .status,
            404
        );
    }
    // The counters are updated right after the response is written, so allow a moment.
    let expected = [
        (
            "sluice_requests_total",
            vec![("route", "api"), ("status", "200")],
            25.0,
        ),
        (
            "sluice_requests_total",
            vec![("route", "_none"), ("status", "404")],
            7.0,
        ),
        (
            "sluice_upstream_attempts_total",
            vec![("route", "api"), ("outcome", "ok")],
            25.0,
        ),
        (
            "sluice_request_duration_seconds_count",
            vec![("route", "api"), ("source", "upstream")],
            25.0,
        ),
    ];
    for (name, labels, want) in expected {
        let ok = support::wait_until_async(Duration::from_secs(20), || async {
            gw.metric(name, &labels).await == Some(want)
        })
        .await;
        assert!(
            ok,
            "{name}{labels:?} should be {want}, got {:?}",
            gw.metric(name, &labels).await
        );
    }
    let per_member: Vec<Option<f64>> = members
        .iter()
        .map(|m| {
            support::metric_value(
                &metrics_blocking(&gw),
                "sluice_upstream_attempts_total",
                &[("member", m), ("outcome", "ok")],
            )
        })
        .collect();
    assert_eq!(per_member, [Some(13.0), Some(12.0)]);
    assert_eq!(
        backends
            .iter()
            .map(|b| b.proxied_requests())
            .collect::<Vec<_>>(),
        [13, 12]
    );
}

/// The metrics text, fetched from inside a synchronous closure.
fn metrics_blocking(gw: &Gateway) -> String {
    tokio::task::block_in_place(|| tokio::runtime::Handle::current().block_on(gw.metrics()))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_lists_routes_and_member_health() {
    let backends = start_backends(&["b1"]).await;
    let members = [url(backends[0].local_addr()), dead_url()];
    let gw = start(api(&members));
    // Two requests: round-robin tries the dead member once, which ejects it.
    for _ in 0..2 {
        assert_eq!(
            request(gw.proxy_addr(), "GET", "api.test", "/", &[], b"")
                .await
                .status,
            200
        );
    }
    let status = gw.status().await;
    assert_eq!(status["version"].as_str().map(str::len), Some(64));
    assert!(status["loaded_at"].is_string());
    assert!(status["last_reload_error"].is_null());
    let route = &status["routes"][0];
    assert_eq!(route["name"], "api");
    assert_eq!(route["selection"], "round_robin");
    assert_eq!(route["members"][0]["healthy"], true);
    assert_eq!(route["members"][1]["url"], members[1].as_str());
    assert_eq!(route["members"][1]["healthy"], false);
    assert_eq!(gw.admin("/healthz").await.status, 200);
    assert_eq!(gw.admin("/readyz").await.status, 200);
}

/// The config builder of the tests writes only what `sluice check` accepts, for every option it
/// has: a typo in a key there would otherwise surface as a confusing failure elsewhere.
#[test]
fn every_option_of_the_test_config_builder_passes_sluice_check() {
    use support::{HealthCheck, Quota, State};
    let full = Route::new("full")
        .hosts(&["full.test", "*.full.test"])
        .path_prefix("/v1/")
        .methods(&["GET", "POST"])
        .weighted_member("http://127.0.0.1:9", 2)
        .member("https://localhost:8443")
        .preserve_host(false)
        .connect_timeout("1s")
        .read_timeout("5s")
        .retries(1)
        .health_check(HealthCheck::fast_http("1s", 2, 3))
        .passive(Passive::cooldown("10s").fall(2))
        .quota(
            Quota::window("burst", 10, "1s")
                .and_window("daily", 1000, "1d")
                .key("header:X-Tenant")
                .cost_default(2)
                .cost_rule("/v1/search", &["GET"], 5)
                .cost_rule("/v1/heavy", &[], 10)
                .on_store_error("closed"),
        );
    let least_used = Route::new("lu")
        .least_used()
        .on_restore("min")
        .members(["http://127.0.0.1:10", "http://127.0.0.1:11"])
        .health_check(HealthCheck::tcp().interval("2s"));
    let empty = Route::new("empty");
    let states = [
        State::memory(),
        State::redis("redis://127.0.0.1:6379/0").timeout("50ms"),
        State::cluster(["redis://127.0.0.1:7001", "redis://127.0.0.1:7002"]),
    ];
    for state in states {
        let config = Config::new()
            .threads(2)
            .admin_token_env("SLUICE_TEST_TOKEN")
            .state(state)
            .routes([full.clone(), least_used.clone(), empty.clone()]);
        assert_eq!(config.check(), Ok(()), "{}", config.yaml());
    }
}
