//! The unit tests of sluice's own modules in vendored crates.
//!
//! `third_party/` stays out of the workspace, so its crates' tests do not run with ours. A
//! module sluice wrote whole, with its tests, is compiled here on its own instead, so that CI
//! runs them (third_party/PATCHES.md says which patch each belongs to).

/// pingora-core's idle pool without a task per connection.
#[path = "../third_party/pingora-core/src/connectors/idle.rs"]
#[allow(dead_code)]
mod idle;

/// pingora-proxy's one-lock task pipe.
#[path = "../third_party/pingora-proxy/src/task_pipe.rs"]
#[allow(dead_code)]
mod task_pipe;

/// pingora-http's header case kept in a list while no name repeats (`case_names.rs`): the
/// names a head writes must be the ones upstream's two lockstep maps wrote, whatever the
/// edits. The model is what those maps amount to: one map whose values carry their case.
mod header_case {
    use bytes::BytesMut;
    use http::{HeaderMap, HeaderName};
    use pingora::http::{RequestHeader, ResponseHeader};
    use proptest::prelude::*;

    const NAMES: &[&str] = &[
        "host",
        "content-length",
        "connection",
        "set-cookie",
        "x-request-id",
        "x-forwarded-for",
        "accept",
        "x-a",
    ];

    #[derive(Debug, Clone)]
    enum Op {
        /// A name with these case bits (bit i uppercases letter i), or `None` for the
        /// parsed `HeaderName` itself (which brings its own case).
        Append(usize, Option<u32>, u8),
        Insert(usize, Option<u32>, u8),
        /// By `&str` in these case bits, or by `&HeaderName`.
        Remove(usize, Option<u32>),
        Reserve(u8),
        Clone,
    }

    fn op() -> impl Strategy<Value = Op> {
        let name = 0..NAMES.len();
        let case = proptest::option::of(any::<u32>());
        prop_oneof![
            4 => (name.clone(), case.clone(), any::<u8>()).prop_map(|(n, c, v)| Op::Append(n, c, v)),
            2 => (name.clone(), case.clone(), any::<u8>()).prop_map(|(n, c, v)| Op::Insert(n, c, v)),
            2 => (name, case).prop_map(|(n, c)| Op::Remove(n, c)),
            1 => (0..4u8).prop_map(Op::Reserve),
            1 => Just(Op::Clone),
        ]
    }

    fn cased(name: &str, bits: u32) -> String {
        name.chars()
            .enumerate()
            .map(|(i, c)| {
                if bits >> (i % 32) & 1 == 1 {
                    c.to_ascii_uppercase()
                } else {
                    c
                }
            })
            .collect()
    }

    /// How upstream writes a `HeaderName` given without case: a head that keeps none says.
    fn own_case(name: &HeaderName) -> Vec<u8> {
        let mut head = RequestHeader::build_no_case("GET", b"/", None).unwrap();
        head.insert_header(name.clone(), "v").unwrap();
        let mut wire = BytesMut::new();
        head.header_to_h1_wire(&mut wire);
        wire[..wire.len() - b": v\r\n".len()].to_vec()
    }

    /// The two head types, edited and written the same way.
    trait Head: Clone {
        fn append(&mut self, name: &'static str, case: Option<u32>, value: String);
        fn insert(&mut self, name: &'static str, case: Option<u32>, value: String);
        fn remove(&mut self, name: &'static str, case: Option<u32>);
        fn reserve(&mut self, n: usize);
        fn wire(&self) -> Vec<u8>;
        fn cases(&self) -> Vec<(Vec<u8>, Vec<u8>)>;
        fn mapped(&self) -> Vec<(Vec<u8>, Vec<u8>)>;
    }

    macro_rules! head {
        ($t:ty) => {
            impl Head for $t {
                fn append(&mut self, name: &'static str, case: Option<u32>, value: String) {
                    match case {
                        Some(bits) => self.append_header(cased(name, bits), value),
                        None => self.append_header(HeaderName::from_static(name), value),
                    }
                    .unwrap();
                }
                fn insert(&mut self, name: &'static str, case: Option<u32>, value: String) {
                    match case {
                        Some(bits) => self.insert_header(cased(name, bits), value),
                        None => self.insert_header(HeaderName::from_static(name), value),
                    }
                    .unwrap();
                }
                fn remove(&mut self, name: &'static str, case: Option<u32>) {
                    match case {
                        Some(bits) => self.remove_header(cased(name, bits).as_str()),
                        None => self.remove_header(&HeaderName::from_static(name)),
                    };
                }
                fn reserve(&mut self, n: usize) {
                    self.reserve_headers(n).unwrap();
                }
                fn wire(&self) -> Vec<u8> {
                    let mut wire = BytesMut::new();
                    self.header_to_h1_wire(&mut wire);
                    wire.to_vec()
                }
                fn cases(&self) -> Vec<(Vec<u8>, Vec<u8>)> {
                    self.case_header_iter()
                        .map(|(n, v)| (n.as_slice().to_vec(), v.as_bytes().to_vec()))
                        .collect()
                }
                fn mapped(&self) -> Vec<(Vec<u8>, Vec<u8>)> {
                    let mut out = Vec::new();
                    self.map(|name, value| {
                        let name = match name {
                            pingora::http::HeaderNameVariant::Case(c) => c.as_slice().to_vec(),
                            pingora::http::HeaderNameVariant::Titled(t) => t.as_bytes().to_vec(),
                        };
                        out.push((name, value.as_bytes().to_vec()));
                        Ok(())
                    })
                    .unwrap();
                    out
                }
            }
        };
    }
    head!(RequestHeader);
    head!(ResponseHeader);

    fn run<H: Head>(mut head: H, ops: &[Op]) -> Result<(), TestCaseError> {
        let mut model: HeaderMap<(Vec<u8>, Vec<u8>)> = HeaderMap::default();
        for op in ops {
            match *op {
                Op::Append(n, case, v) | Op::Insert(n, case, v) => {
                    let key = HeaderName::from_static(NAMES[n]);
                    let written = match case {
                        Some(bits) => cased(NAMES[n], bits).into_bytes(),
                        None => own_case(&key),
                    };
                    let value = format!("v{v}");
                    if matches!(op, Op::Append(..)) {
                        head.append(NAMES[n], case, value.clone());
                        model.append(key, (written, value.into_bytes()));
                    } else {
                        head.insert(NAMES[n], case, value.clone());
                        model.insert(key, (written, value.into_bytes()));
                    }
                }
                Op::Remove(n, case) => {
                    head.remove(NAMES[n], case);
                    model.remove(NAMES[n]);
                }
                Op::Reserve(n) => head.reserve(n as usize),
                Op::Clone => head = head.clone(),
            }
            let pairs: Vec<(Vec<u8>, Vec<u8>)> = model.values().cloned().collect();
            let mut wire = Vec::new();
            for (name, value) in &pairs {
                wire.extend_from_slice(name);
                wire.extend_from_slice(b": ");
                wire.extend_from_slice(value);
                wire.extend_from_slice(b"\r\n");
            }
            let written = head.wire();
            prop_assert_eq!(
                String::from_utf8_lossy(&written),
                String::from_utf8_lossy(&wire),
                "after {:?}",
                op
            );
            prop_assert_eq!(&head.cases(), &pairs);
            prop_assert_eq!(&head.mapped(), &pairs);
        }
        Ok(())
    }

    proptest! {
        #[test]
        fn a_request_head_writes_each_name_as_it_was_given(ops in proptest::collection::vec(op(), 1..40)) {
            run(RequestHeader::build("GET", b"/", None).unwrap(), &ops)?;
        }

        #[test]
        fn a_response_head_writes_each_name_as_it_was_given(ops in proptest::collection::vec(op(), 1..40)) {
            run(ResponseHeader::build(200, Some(2)).unwrap(), &ops)?;
        }
    }

    /// A head built without case writes names titled or in lowercase, as upstream's does.
    #[test]
    fn a_head_without_case_writes_titles_and_lowercase() {
        let mut head = ResponseHeader::build_no_case(200, None).unwrap();
        head.append_header("X-Mixed-Case", "1").unwrap();
        head.append_header("CONTENT-TYPE", "2").unwrap();
        assert_eq!(head.wire(), b"x-mixed-case: 1\r\nContent-Type: 2\r\n");
        assert!(head.case_header_iter().next().is_none());
    }
}

/// pingora-core's response framing read once (`client.rs`, `ResponseFraming`): the member's body
/// is framed by what `validate_response` found when the head was read, not by the head read a
/// second time. Each case is a real connection. The member writes a raw response and keeps the
/// connection open unless the case says it closes, so that a body framed by length or chunks
/// must end without waiting for the close (a wrong framing would hang, which the timeout
/// turns into a failure).
mod response_framing {
    use std::time::Duration;

    use pingora::http::RequestHeader;
    use pingora::protocols::http::v1::client::HttpSession;
    use pingora::protocols::l4::stream::Stream;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::{TcpListener, TcpStream};

    struct Case {
        method: &'static str,
        response: &'static [u8],
        /// The member closes the connection after the response.
        closes: bool,
        tolerate_invalid_length: bool,
    }

    fn case(response: &'static [u8]) -> Case {
        Case {
            method: "GET",
            response,
            closes: false,
            tolerate_invalid_length: false,
        }
    }

    /// The body the client session reads, and whether it would reuse the connection; or the
    /// error reading the head.
    async fn exchange(c: Case) -> Result<(Vec<u8>, bool), String> {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (response, closes) = (c.response, c.closes);
        let member = tokio::spawn(async move {
            let (mut socket, _) = listener.accept().await.unwrap();
            let mut head = Vec::new();
            let mut byte = [0u8; 1];
            while !head.ends_with(b"\r\n\r\n") {
                if socket.read(&mut byte).await.unwrap() == 0 {
                    return;
                }
                head.push(byte[0]);
            }
            socket.write_all(response).await.unwrap();
            if !closes {
                // Open until the client is done with it.
                let mut rest = Vec::new();
                let _ = socket.read_to_end(&mut rest).await;
            }
        });
        let client = async {
            let tcp = TcpStream::connect(addr).await.unwrap();
            let mut session = HttpSession::new(Box::new(Stream::from(tcp)));
            session.set_allow_h1_response_invalid_content_length(c.tolerate_invalid_length);
            let mut req = RequestHeader::build(c.method, b"/", None).unwrap();
            req.insert_header("host", "member.test").unwrap();
            session.write_request_header(Box::new(req)).await.unwrap();
            session.read_response().await.map_err(|e| e.to_string())?;
            // An informational head is followed by the final one, as read_response_task reads.
            while session.get_status().is_some_and(|s| s.is_informational()) {
                session.read_response().await.map_err(|e| e.to_string())?;
            }
            let mut body = Vec::new();
            while let Some(chunk) = session.read_body_bytes().await.map_err(|e| e.to_string())? {
                body.extend_from_slice(&chunk);
            }
            session.respect_keepalive();
            Ok((body, session.will_keepalive()))
        };
        let result = tokio::time::timeout(Duration::from_secs(10), client)
            .await
            .expect("the body ends as its framing says, without waiting for a close");
        member.abort();
        result
    }

    #[tokio::test]
    async fn bodies_end_where_their_framing_says() {
        let closing = |response| Case {
            closes: true,
            ..case(response)
        };
        /// What is read: the body and whether the connection would be reused; `None` when the
        /// head is refused.
        type Read = Option<(Vec<u8>, bool)>;
        let body = |b: &[u8], reused: bool| Some((b.to_vec(), reused));
        let cases: [(&str, Case, Read); 17] = [
            (
                "by length",
                case(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello"),
                body(b"hello", true),
            ),
            (
                "by chunks",
                case(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n"),
                body(b"hello", true),
            ),
            (
                "chunks win over a length",
                case(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n"),
                body(b"hello", true),
            ),
            (
                "a transfer coding without chunked: until the close",
                closing(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip\r\n\r\nhello"),
                body(b"hello", false),
            ),
            (
                "no framing: until the close",
                closing(b"HTTP/1.1 200 OK\r\nServer: x\r\n\r\nhello"),
                body(b"hello", false),
            ),
            (
                "HEAD: no body, whatever the length",
                Case {
                    method: "HEAD",
                    ..case(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\n")
                },
                body(b"", true),
            ),
            (
                "204: no body",
                case(b"HTTP/1.1 204 No Content\r\n\r\n"),
                body(b"", true),
            ),
            (
                "identical lengths are one",
                case(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nContent-Length: 5\r\n\r\nhello"),
                body(b"hello", true),
            ),
            (
                "a list of one length is that length",
                case(b"HTTP/1.1 200 OK\r\nContent-Length: 5, 5\r\n\r\nhello"),
                body(b"hello", true),
            ),
            (
                "chunks win over an invalid length",
                case(b"HTTP/1.1 200 OK\r\nContent-Length: abc\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n"),
                body(b"hello", true),
            ),
            (
                "204: no body, whatever the length",
                case(b"HTTP/1.1 204 No Content\r\nContent-Length: 5\r\n\r\n"),
                body(b"", true),
            ),
            (
                "304: no body, whatever the length",
                case(b"HTTP/1.1 304 Not Modified\r\nContent-Length: 5\r\n\r\n"),
                body(b"", true),
            ),
            (
                "chunks on HTTP/1.0: read, and the connection not reused",
                case(b"HTTP/1.0 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n"),
                body(b"hello", false),
            ),
            (
                "conflicting lengths are refused",
                case(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nContent-Length: 6\r\n\r\nhello!"),
                None,
            ),
            (
                "an invalid length is refused",
                case(b"HTTP/1.1 200 OK\r\nContent-Length: abc\r\n\r\nhello"),
                None,
            ),
            (
                "an invalid length tolerated: until the close",
                Case {
                    tolerate_invalid_length: true,
                    ..closing(b"HTTP/1.1 200 OK\r\nContent-Length: abc\r\n\r\nhello")
                },
                body(b"hello", false),
            ),
            (
                "a 100 first: the final head's framing counts",
                case(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello"),
                body(b"hello", true),
            ),
        ];
        for (name, c, expected) in cases {
            assert_eq!(exchange(c).await.ok(), expected, "{name}");
        }
    }
}
