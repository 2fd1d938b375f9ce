//! Parsing and normalizing request targets: each rule by example, and properties by proptest.

use super::*;
use proptest::prelude::*;

fn norm(p: &str) -> Result<String, Reject> {
    normalize_path(p).map(Cow::into_owned)
}

fn get<'a>(target: &'a str, host: Option<&'a str>) -> Result<Target<'a>, Reject> {
    parse(
        &Method::GET,
        Version::HTTP_11,
        target.as_bytes(),
        host.map(str::as_bytes),
    )
}

#[test]
fn the_four_spellings_of_the_bug_report_are_one_path() {
    for p in [
        "/v1//search",
        "/v1/./search",
        "/v1/%73earch",
        "/v1/x/../search",
    ] {
        assert_eq!(norm(p).as_deref(), Ok("/v1/search"), "{p}");
    }
}

#[test]
fn normal_paths_are_borrowed() {
    for p in [
        "/",
        "/v1/search",
        "/v1/search/",
        "/a/b.c/..d/...",
        "/a;b=c/@x:y/~u_v-w!$&'()*+,=",
        "/a/%3B/%25",
    ] {
        let n = normalize_path(p).unwrap();
        assert!(matches!(n, Cow::Borrowed(_)), "{p}");
        assert_eq!(n, p);
    }
}

#[test]
fn slashes_merge_and_dot_segments_go() {
    for (p, want) in [
        ("//", "/"),
        ("///a///b///", "/a/b/"),
        ("/.", "/"),
        ("/./", "/"),
        ("/a/.", "/a/"),
        ("/a/..", "/"),
        ("/a/b/..", "/a/"),
        ("/a/b/../", "/a/"),
        ("/a/./b/../../c", "/c"),
        ("/a//../b", "/b"),
        ("/a/%2e/b", "/a/b"),
        ("/a/%2E%2e/b", "/b"),
        ("/a/.%2e/b", "/b"),
        ("/a/%2e./b", "/b"),
        ("/a/b/%2E%2E", "/a/"),
        ("/a/.../b", "/a/.../b"),
        ("/a/..b/c", "/a/..b/c"),
    ] {
        assert_eq!(norm(p).as_deref(), Ok(want), "{p}");
    }
}

#[test]
fn unreserved_escapes_decode_and_others_are_uppercased() {
    for (p, want) in [
        ("/%41%7a%30%2D%2e%5f%7E", "/Az0-._~"),
        ("/a%3bb", "/a%3Bb"),
        ("/%3B", "/%3B"),
        ("/a%20b", "/a%20b"),
        ("/%25", "/%25"),
        ("/%252e%252e", "/%252e%252e"),
        ("/%c3%a9", "/%C3%A9"),
    ] {
        assert_eq!(norm(p).as_deref(), Ok(want), "{p}");
    }
}

#[test]
fn bytes_that_may_not_appear_raw_are_encoded() {
    assert_eq!(
        norm("/a{b}|\"^`<>[]").as_deref(),
        Ok("/a%7Bb%7D%7C%22%5E%60%3C%3E%5B%5D")
    );
    assert_eq!(norm("/café").as_deref(), Ok("/caf%C3%A9"));
    // Raw and escaped spellings of one byte are one path.
    assert_eq!(norm("/caf%c3%a9"), norm("/café"));
}

#[test]
fn what_cannot_be_normalized_safely_is_refused() {
    for p in [
        "", "a/b", "*", "/..", "/../a", "/a/../..", "/./..", "/%2e%2e", "/a%2Fb", "/a%2fb",
        "/a%5Cb", "/a%5cb", "/a\\b", "/a\0b", "/a%00b", "/a%0Ab", "/a%7Fb", "/a\tb", "/a b",
        "/a#b", "/a?b", "/%", "/%4", "/%zz", "/%4g",
    ] {
        assert_eq!(norm(p), Err(Reject::BadPath), "{p:?}");
    }
}

#[test]
fn origin_form_takes_host_from_the_header() {
    let t = get("/v1/search?q=a//b", Some("API.example.com:8443")).unwrap();
    assert_eq!(t.form, Form::Origin);
    assert_eq!(t.scheme, None);
    assert_eq!(t.authority, "API.example.com:8443");
    assert_eq!(t.host, "api.example.com");
    assert_eq!(t.port, Some(8443));
    assert_eq!(t.path, "/v1/search");
    assert_eq!(t.query, Some("q=a//b"));
    assert!(!t.rewritten);
    assert!(matches!(
        t.origin_form(),
        Cow::Borrowed("/v1/search?q=a//b")
    ));
    assert!(matches!(t.path, Cow::Borrowed(_)));
    assert!(matches!(t.host, Cow::Owned(_)));

    let t = get("/v1/./search?", Some(" api.test ")).unwrap();
    assert_eq!(
        (&*t.host, t.authority, t.port),
        ("api.test", "api.test", None)
    );
    assert!(matches!(t.host, Cow::Borrowed(_)));
    assert_eq!(t.query, Some(""));
    assert!(t.rewritten);
    assert_eq!(t.origin_form(), "/v1/search?");
}

#[test]
fn http_11_needs_a_host_and_http_10_does_not() {
    assert_eq!(get("/", None), Err(Reject::MissingHost));
    assert_eq!(get("/", Some("")), Err(Reject::MissingHost));
    assert_eq!(get("/", Some("  ")), Err(Reject::MissingHost));
    assert_eq!(get("/", Some(":80")), Err(Reject::MissingHost));
    let h2 = parse(&Method::GET, Version::HTTP_2, b"/", None);
    assert_eq!(h2, Err(Reject::MissingHost));
    let t = parse(&Method::GET, Version::HTTP_10, b"/x", None).unwrap();
    assert_eq!((t.authority, &*t.host, t.port), ("", "", None));
}

#[test]
fn absolute_form_authority_wins() {
    let t = get("http://Api.Test:8080/v1//x?a=1", Some("ignored.test")).unwrap();
    assert_eq!(t.form, Form::Absolute);
    assert_eq!(t.scheme, Some(Scheme::Http));
    assert_eq!(t.authority, "Api.Test:8080");
    assert_eq!(t.host, "api.test");
    assert_eq!(t.port, Some(8080));
    assert_eq!(t.path, "/v1/x");
    assert_eq!(t.query, Some("a=1"));
    assert!(t.rewritten);
    assert_eq!(t.origin_form(), "/v1/x?a=1");

    let t = get("HTTP://api.test", None).unwrap();
    assert_eq!(
        (t.scheme, &*t.path, t.query),
        (Some(Scheme::Http), "/", None)
    );
    assert!(!t.rewritten);
    assert_eq!(t.origin_form(), "/");
    let t = get("http://api.test?x", None).unwrap();
    assert_eq!(t.origin_form(), "/?x");
    let t = get("http://api.test/a/b?x", None).unwrap();
    assert!(matches!(t.origin_form(), Cow::Borrowed("/a/b?x")));
}

#[test]
fn https_is_reported_and_other_schemes_refused() {
    let t = get("https://api.test/x", None).unwrap();
    assert_eq!(t.scheme, Some(Scheme::Https));
    assert_eq!(
        get("ws://api.test/", None).unwrap().scheme,
        Some(Scheme::Http)
    );
    assert_eq!(
        get("WSS://api.test/", None).unwrap().scheme,
        Some(Scheme::Https)
    );
    for target in ["ftp://api.test/x", "wsx://api.test/", "file:///etc"] {
        assert_eq!(
            get(target, None),
            Err(Reject::UnsupportedScheme),
            "{target}"
        );
    }
    for target in [
        "http:api.test/x",
        "http:/api.test",
        "1http://x/",
        "api.test:80",
        "://x/",
    ] {
        assert_eq!(get(target, None), Err(Reject::BadPath), "{target}");
    }
    assert_eq!(get("http:///x", None), Err(Reject::MissingHost));
    assert_eq!(get("http://a.test#f", None), Err(Reject::BadPath));
    assert_eq!(get("http://a.test/%2e%2e/x", None), Err(Reject::BadPath));
}

#[test]
fn hosts_are_one_spelling_or_refused() {
    let host = |h: &str| get("/", Some(h)).map(|t| (t.host.into_owned(), t.port));
    assert_eq!(host("Example.COM."), Ok(("example.com".into(), None)));
    assert_eq!(host("a_b-c.test:"), Ok(("a_b-c.test".into(), None)));
    assert_eq!(host("127.0.0.1:80"), Ok(("127.0.0.1".into(), Some(80))));
    assert_eq!(host("[::1]:8080"), Ok(("::1".into(), Some(8080))));
    assert_eq!(host("[0:0::1]"), Ok(("::1".into(), None)));
    assert_eq!(
        host("[::FFFF:1.2.3.4]"),
        Ok(("::ffff:1.2.3.4".into(), None))
    );
    assert_eq!(
        host("[2001:DB8::1]:443"),
        Ok(("2001:db8::1".into(), Some(443)))
    );
    assert_eq!(host("3com.example"), Ok(("3com.example".into(), None)));
    for bad in [
        "user@api.test",
        "a@b@c",
        "api.test:0",
        "api.test:65536",
        "api.test:8x",
        "api.test:80:80",
        "::1",
        "[::1",
        "[::1]x",
        "[fe80::1%25eth0]",
        "[v1.x]",
        "[]",
        "a..b",
        ".a",
        "..",
        ".",
        "a b",
        "a/b",
        "a\\b",
        "a%2eb",
        "a*b",
        "2130706433",
        "127.1",
        "0x7f.0.0.1",
        "127.0.0.01",
        "a.0x1F",
        "caf\u{e9}.test",
    ] {
        assert_eq!(host(bad), Err(Reject::BadHost), "{bad:?}");
    }
}

#[test]
fn connect_takes_an_authority_with_a_port() {
    let connect = |t: &'static str| parse(&Method::CONNECT, Version::HTTP_11, t.as_bytes(), None);
    let t = connect("API.test:443").unwrap();
    assert_eq!(t.form, Form::Authority);
    assert_eq!(
        (&*t.host, t.port, t.authority),
        ("api.test", Some(443), "API.test:443")
    );
    assert_eq!(
        (&*t.path, t.query, t.origin_form()),
        ("", None, Cow::Borrowed(""))
    );
    let t = connect("[::1]:443").unwrap();
    assert_eq!((&*t.host, t.port), ("::1", Some(443)));
    assert_eq!(connect("api.test"), Err(Reject::BadHost));
    assert_eq!(connect("api.test:"), Err(Reject::BadHost));
    assert_eq!(connect("/x"), Err(Reject::BadHost));
    assert_eq!(connect(""), Err(Reject::MissingHost));
}

#[test]
fn asterisk_is_for_options_only() {
    let t = parse(&Method::OPTIONS, Version::HTTP_11, b"*", Some(b"a.test")).unwrap();
    assert_eq!(
        (t.form, &*t.path, &*t.host),
        (Form::Asterisk, "*", "a.test")
    );
    assert_eq!(t.origin_form(), "*");
    assert_eq!(get("*", Some("a.test")), Err(Reject::BadPath));
    let no_host = parse(&Method::OPTIONS, Version::HTTP_11, b"*", None);
    assert_eq!(no_host, Err(Reject::MissingHost));
    assert_eq!(
        parse(&Method::OPTIONS, Version::HTTP_11, b"*x", Some(b"a")),
        Err(Reject::BadPath)
    );
}

#[test]
fn queries_are_split_not_normalized() {
    let t = get("/a?b=%2F..//&c=%zz?d", Some("h")).unwrap();
    assert_eq!(t.query, Some("b=%2F..//&c=%zz?d"));
    for bad in ["/a?b\0", "/a?b c", "/a?b#c", "/a?\x7f"] {
        assert_eq!(get(bad, Some("h")), Err(Reject::BadQuery), "{bad:?}");
    }
    let latin1 = parse(&Method::GET, Version::HTTP_11, b"/a?\xe9", Some(b"h"));
    assert_eq!(latin1, Err(Reject::BadQuery));
    // Raw non-UTF-8 in the path is encoded, not refused.
    let t = parse(&Method::GET, Version::HTTP_11, b"/caf\xe9", Some(b"h")).unwrap();
    assert_eq!(t.path, "/caf%E9");
}

#[test]
fn rejects_have_a_code_and_a_400() {
    for r in [
        Reject::BadPath,
        Reject::BadQuery,
        Reject::MissingHost,
        Reject::BadHost,
        Reject::UnsupportedScheme,
    ] {
        assert_eq!(r.status(), StatusCode::BAD_REQUEST);
        assert!(!r.code().is_empty() && !r.to_string().is_empty());
    }
}

/// An independent model: decode, merge slashes, then RFC 3986 §5.2.4's string algorithm
/// as written, refusing a climb above the root.
fn model(path: &str) -> Result<String, Reject> {
    let b = path.as_bytes();
    if b.first() != Some(&b'/') {
        return Err(Reject::BadPath);
    }
    let mut decoded = String::new();
    let mut i = 0;
    while i < b.len() {
        let c = b[i];
        if c == b'%' {
            let hex = path.get(i + 1..i + 3).ok_or(Reject::BadPath)?;
            let v = u8::from_str_radix(hex, 16).map_err(|_| Reject::BadPath)?;
            if !hex.bytes().all(|h| h.is_ascii_hexdigit()) {
                return Err(Reject::BadPath);
            }
            if v.is_ascii_alphanumeric() || b"-._~".contains(&v) {
                decoded.push(v as char);
            } else if v < 0x20 || v == 0x7f || v == b'/' || v == b'\\' {
                return Err(Reject::BadPath);
            } else {
                decoded.push_str(&format!("%{v:02X}"));
            }
            i += 3;
            continue;
        }
        if c <= 0x20 || c == 0x7f || b"#?\\".contains(&c) {
            return Err(Reject::BadPath);
        }
        if c.is_ascii_alphanumeric() || b"-._~!$&'()*+,;=:@/".contains(&c) {
            decoded.push(c as char);
        } else {
            decoded.push_str(&format!("%{c:02X}"));
        }
        i += 1;
    }
    let mut input = String::new();
    for ch in decoded.chars() {
        if !(ch == '/' && input.ends_with('/')) {
            input.push(ch);
        }
    }
    let mut output = String::new();
    while !input.is_empty() {
        if let Some(rest) = input.strip_prefix("../").or(input.strip_prefix("./")) {
            input = rest.to_string();
        } else if input.starts_with("/./") {
            input.replace_range(..3, "/");
        } else if input == "/." {
            input = "/".into();
        } else if input.starts_with("/../") || input == "/.." {
            if output.is_empty() {
                return Err(Reject::BadPath);
            }
            let n = if input == "/.." { 3 } else { 4 };
            input.replace_range(..n, "/");
            let cut = output.rfind('/').unwrap_or(0);
            output.truncate(cut);
        } else if input == "." || input == ".." {
            input.clear();
        } else {
            let end = input[1..].find('/').map_or(input.len(), |j| j + 1);
            output.push_str(&input[..end]);
            input.replace_range(..end, "");
        }
    }
    Ok(output)
}

/// What a typical server serves: every escape decoded, empty and `.` segments dropped, `..`
/// popped (clamped at the root).
fn served(path: &str) -> Vec<Vec<u8>> {
    let mut bytes = Vec::new();
    let b = path.as_bytes();
    let mut i = 0;
    while i < b.len() {
        let decoded = (b[i] == b'%')
            .then(|| path.get(i + 1..i + 3))
            .flatten()
            .and_then(|h| u8::from_str_radix(h, 16).ok());
        match decoded {
            Some(v) => {
                bytes.push(v);
                i += 3;
            }
            None => {
                bytes.push(b[i]);
                i += 1;
            }
        }
    }
    let mut segments: Vec<Vec<u8>> = Vec::new();
    for s in bytes.split(|&c| c == b'/') {
        match s {
            b"" | b"." => {}
            b".." => {
                segments.pop();
            }
            s => segments.push(s.to_vec()),
        }
    }
    segments
}

/// Spellings a client might use for one segment.
fn noisy_segment(segment: &'static str) -> impl Strategy<Value = String> {
    proptest::collection::vec((any::<bool>(), any::<bool>()), segment.len()).prop_map(
        move |flips| {
            segment
                .bytes()
                .zip(flips)
                .map(|(c, (escape, lower))| match (escape, lower) {
                    (false, _) => (c as char).to_string(),
                    (true, false) => format!("%{c:02X}"),
                    (true, true) => format!("%{c:02x}"),
                })
                .collect()
        },
    )
}

/// Noise that addresses nothing: `./`, `x/../`, `/`, or nothing.
fn noise() -> impl Strategy<Value = &'static str> {
    prop_oneof![
        Just(""),
        Just("/"),
        Just("./"),
        Just("%2e/"),
        Just("%2E/"),
        Just("x/../"),
        Just("x/%2e%2e/"),
        Just("a/b/../../"),
        Just("y/.%2e/"),
    ]
}

fn clean_path() -> impl Strategy<Value = Vec<&'static str>> {
    proptest::collection::vec(
        prop_oneof![
            Just("v1"),
            Just("search"),
            Just("items"),
            Just("a-b_c~d.e"),
            Just("%3B"),
            Just("x;y=z"),
        ],
        1..5,
    )
}

/// Any string over the path alphabet, escapes and the troublesome bytes included.
fn any_path() -> impl Strategy<Value = String> {
    proptest::string::string_regex(
        "/([a-zA-Z0-9._~/;:@!%{\"é\\\\-]|%[0-9a-fA-F]{2}|\\.\\.|//|/\\./){0,24}",
    )
    .unwrap()
}

fn assert_normal(n: &str) {
    assert!(n.starts_with('/'), "{n}");
    assert!(n.is_ascii(), "{n}");
    for bad in ["//", "/./", "/../"] {
        assert!(!n.contains(bad), "{n} holds {bad}");
    }
    assert!(!n.ends_with("/.") && !n.ends_with("/.."), "{n}");
    let b = n.as_bytes();
    for (i, _) in n.match_indices('%') {
        let hex = &n[i + 1..i + 3];
        assert!(
            hex.bytes()
                .all(|h| h.is_ascii_digit() || h.is_ascii_uppercase()),
            "{n}"
        );
        let v = u8::from_str_radix(hex, 16).unwrap();
        assert!(!is_unreserved(v), "{n} escapes an unreserved byte");
    }
    assert!(b.iter().all(|&c| CLASS[c as usize] != Class::Refuse), "{n}");
}

/// What `last_label` replaced: the checks by `str` splits, the reference it must agree with.
fn last_label_by_splits(name: &str) -> Option<&str> {
    let valid = !name.is_empty()
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_'))
        && name.split('.').all(|label| !label.is_empty());
    valid.then(|| name.rsplit('.').next().unwrap_or(name))
}

proptest! {
    #[test]
    fn last_label_agrees_with_the_label_split(name in "[a-fA-F0-9xX._:@-]{0,12}") {
        prop_assert_eq!(last_label(&name), last_label_by_splits(&name));
    }

    #[test]
    fn noise_normalizes_back_to_the_clean_path(
        segments in clean_path(),
        noise in proptest::collection::vec(noise(), 5),
        spellings in proptest::collection::vec(noisy_segment("search"), 4),
    ) {
        let clean = format!("/{}", segments.join("/"));
        let mut noisy = String::from("/");
        for (i, s) in segments.iter().enumerate() {
            noisy.push_str(noise[i % noise.len()]);
            if *s == "search" {
                noisy.push_str(&spellings[i % spellings.len()]);
            } else {
                noisy.push_str(s);
            }
            noisy.push('/');
            if i + 1 < segments.len() && i % 2 == 0 {
                noisy.push('/');
            }
        }
        noisy.pop();
        let n = normalize_path(&noisy).unwrap();
        prop_assert_eq!(&*n, clean.as_str(), "from {}", noisy);
    }

    #[test]
    fn normalization_is_idempotent_and_normal(p in any_path()) {
        if let Ok(n) = normalize_path(&p) {
            assert_normal(&n);
            let again = normalize_path(&n).unwrap();
            prop_assert!(matches!(again, Cow::Borrowed(_)), "{} is not a fixed point", n);
            prop_assert_eq!(again, n.clone());
        }
    }

    #[test]
    fn the_model_agrees(p in any_path()) {
        prop_assert_eq!(norm(&p), model(&p), "{}", p);
    }

    #[test]
    fn what_is_charged_is_what_is_served(p in any_path()) {
        if let Ok(n) = normalize_path(&p) {
            // The member serves the same resource for the client's path and for ours.
            prop_assert_eq!(served(&n), served(&p), "{} -> {}", p, n);
            // And a resource under /v1/search is charged as /v1/search.
            let s = served(&p);
            if s.len() >= 2 && s[0] == b"v1" && s[1] == b"search" {
                prop_assert!(n.starts_with("/v1/search"), "{} -> {}", p, n);
            }
        }
    }

    #[test]
    fn any_bytes_parse_without_panic(target in proptest::collection::vec(any::<u8>(), 0..40),
                                     host in proptest::option::of(proptest::collection::vec(any::<u8>(), 0..20))) {
        for method in [Method::GET, Method::CONNECT, Method::OPTIONS] {
            if let Ok(t) = parse(&method, Version::HTTP_11, &target, host.as_deref()) {
                if t.form == Form::Origin || t.form == Form::Absolute {
                    assert_normal(&t.path);
                }
            }
        }
    }
}
