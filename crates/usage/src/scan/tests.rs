use std::io::Write as _;

use proptest::prelude::*;

use super::*;

const MIB: usize = 1024 * 1024;

fn amount(json: &str) -> Amount {
    crate::spec::from_config_json(json)
}

fn total_tokens() -> Amount {
    amount(r#"{"json": "usage.total_tokens"}"#)
}

fn headers(pairs: &[(&str, &str)]) -> http::HeaderMap {
    let mut h = http::HeaderMap::new();
    for (name, value) in pairs {
        h.append(
            http::HeaderName::from_bytes(name.as_bytes()).unwrap(),
            value.parse().unwrap(),
        );
    }
    h
}

const JSON: (&str, &str) = ("content-type", "application/json");
const SSE: (&str, &str) = ("content-type", "text/event-stream; charset=utf-8");

/// A scanner settling `amount` alone.
fn scan_one(amount: &Amount, max: usize, head: &http::HeaderMap) -> ResponseScanner {
    ResponseScanner::new(std::slice::from_ref(amount), max, head)
}

/// The outcome of a scanner of one amount.
fn one(scanner: ResponseScanner) -> Result<Millionths, Unsettled> {
    let mut outcomes = scanner.finish();
    assert_eq!(outcomes.len(), 1);
    outcomes.remove(0)
}

/// The settlement of `body` fed in pieces cut at `cuts`.
fn settle_cut(
    amount: &Amount,
    max: usize,
    head: &http::HeaderMap,
    body: &[u8],
    cuts: &[usize],
) -> Result<Millionths, Unsettled> {
    let mut scanner = scan_one(amount, max, head);
    let mut from = 0;
    for &cut in cuts.iter().chain(std::iter::once(&body.len())) {
        let cut = cut.clamp(from, body.len());
        scanner.feed(&body[from..cut]);
        from = cut;
    }
    one(scanner)
}

fn settle(amount: &Amount, head: &http::HeaderMap, body: &[u8]) -> Result<Millionths, Unsettled> {
    settle_cut(amount, MIB, head, body, &[])
}

fn units(n: u64) -> Result<Millionths, Unsettled> {
    Ok(Millionths::from_units(n).unwrap())
}

/// A non-streaming chat completion, as OpenAI answers it.
const OPENAI_JSON: &str = r#"{
  "id": "chatcmpl-AbC123",
  "object": "chat.completion",
  "created": 1733356800,
  "model": "gpt-4o-mini-2024-07-18",
  "choices": [{"index": 0, "message": {"role": "assistant", "content": "Hello! How can I help?", "refusal": null}, "logprobs": null, "finish_reason": "stop"}],
  "usage": {"prompt_tokens": 9, "completion_tokens": 12, "total_tokens": 21,
            "prompt_tokens_details": {"cached_tokens": 0, "audio_tokens": 0},
            "completion_tokens_details": {"reasoning_tokens": 0, "audio_tokens": 0}},
  "system_fingerprint": "fp_0ba0d124f1"
}"#;

/// A streamed chat completion with `stream_options: {include_usage: true}`: every chunk has
/// `"usage": null` but the last, whose choices are empty, then `[DONE]`.
const OPENAI_SSE: &str = concat!(
    "data: {\"id\":\"chatcmpl-1\",\"object\":\"chat.completion.chunk\",\"created\":1733356800,\"model\":\"gpt-4o-mini\",\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\",\"content\":\"\"},\"finish_reason\":null}],\"usage\":null}\n\n",
    "data: {\"id\":\"chatcmpl-1\",\"object\":\"chat.completion.chunk\",\"created\":1733356800,\"model\":\"gpt-4o-mini\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\"Hi\"},\"finish_reason\":null}],\"usage\":null}\n\n",
    "data: {\"id\":\"chatcmpl-1\",\"object\":\"chat.completion.chunk\",\"created\":1733356800,\"model\":\"gpt-4o-mini\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\" total_tokens\"},\"finish_reason\":null}],\"usage\":null}\n\n",
    "data: {\"id\":\"chatcmpl-1\",\"object\":\"chat.completion.chunk\",\"created\":1733356800,\"model\":\"gpt-4o-mini\",\"choices\":[{\"index\":0,\"delta\":{},\"finish_reason\":\"stop\"}],\"usage\":null}\n\n",
    "data: {\"id\":\"chatcmpl-1\",\"object\":\"chat.completion.chunk\",\"created\":1733356800,\"model\":\"gpt-4o-mini\",\"choices\":[],\"usage\":{\"prompt_tokens\":9,\"completion_tokens\":2,\"total_tokens\":11}}\n\n",
    "data: [DONE]\n\n",
);

/// A streamed Anthropic message: input tokens in `message_start`, output tokens (cumulative)
/// in `message_delta`, with CRLF line ends as some proxies rewrite them.
const ANTHROPIC_SSE: &str = concat!(
    "event: message_start\r\n",
    "data: {\"type\":\"message_start\",\"message\":{\"id\":\"msg_01\",\"type\":\"message\",\"role\":\"assistant\",\"content\":[],\"model\":\"claude-3-5-sonnet-20241022\",\"stop_reason\":null,\"stop_sequence\":null,\"usage\":{\"input_tokens\":25,\"output_tokens\":1}}}\r\n\r\n",
    "event: content_block_start\r\n",
    "data: {\"type\":\"content_block_start\",\"index\":0,\"content_block\":{\"type\":\"text\",\"text\":\"\"}}\r\n\r\n",
    "event: ping\r\n",
    "data: {\"type\": \"ping\"}\r\n\r\n",
    "event: content_block_delta\r\n",
    "data: {\"type\":\"content_block_delta\",\"index\":0,\"delta\":{\"type\":\"text_delta\",\"text\":\"Hello\"}}\r\n\r\n",
    "event: content_block_stop\r\n",
    "data: {\"type\":\"content_block_stop\",\"index\":0}\r\n\r\n",
    "event: message_delta\r\n",
    "data: {\"type\":\"message_delta\",\"delta\":{\"stop_reason\":\"end_turn\",\"stop_sequence\":null},\"usage\":{\"output_tokens\":15}}\r\n\r\n",
    "event: message_stop\r\n",
    "data: {\"type\":\"message_stop\"}\r\n\r\n",
);

fn anthropic_tokens() -> Amount {
    amount(r#"{"sum": [{"json": "message.usage.input_tokens"}, {"json": "usage.output_tokens"}]}"#)
}

/// The contract's spend unit: $2.50 per million prompt tokens, $10 per million completion.
fn usd() -> Amount {
    amount(
        r#"{"sum": [{"json": "usage.prompt_tokens", "times": 0.0000025},
                    {"json": "usage.completion_tokens", "times": 0.00001}]}"#,
    )
}

#[test]
fn openai_json_settles_tokens_and_spend() {
    let h = headers(&[JSON]);
    assert_eq!(
        settle(&total_tokens(), &h, OPENAI_JSON.as_bytes()),
        units(21)
    );
    // 9 × 2.5 = 22.5 millionths, rounded up to 23, plus 12 × 10 = 120.
    assert_eq!(
        settle(&usd(), &h, OPENAI_JSON.as_bytes()),
        Ok(Millionths(143))
    );
    // A content type that says nothing is still read as JSON.
    assert_eq!(
        settle(&total_tokens(), &headers(&[]), OPENAI_JSON.as_bytes()),
        units(21)
    );
}

#[test]
fn openai_stream_settles_from_its_final_usage_chunk() {
    let h = headers(&[SSE]);
    assert_eq!(
        settle(&total_tokens(), &h, OPENAI_SSE.as_bytes()),
        units(11)
    );
    assert_eq!(
        settle(&usd(), &h, OPENAI_SSE.as_bytes()),
        Ok(Millionths(23 + 20))
    );
    // Without include_usage no chunk holds the path.
    let without: String = OPENAI_SSE
        .split_inclusive("\n\n")
        .filter(|event| !event.contains("\"total_tokens\""))
        .collect();
    assert_eq!(
        settle(&total_tokens(), &h, without.as_bytes()),
        Err(Unsettled::NoUsage)
    );
    let with_default = amount(r#"{"json": "usage.total_tokens", "default": 7}"#);
    assert_eq!(settle(&with_default, &h, without.as_bytes()), units(7));
}

#[test]
fn anthropic_stream_sums_message_start_and_message_delta() {
    let h = headers(&[SSE]);
    assert_eq!(
        settle(&anthropic_tokens(), &h, ANTHROPIC_SSE.as_bytes()),
        units(40)
    );
}

#[test]
fn the_last_event_holding_the_path_wins() {
    let h = headers(&[SSE]);
    let stream = b"data: {\"usage\":{\"total_tokens\":5}}\n\ndata: {\"usage\":{\"total_tokens\":8}}\n\ndata: {\"other\":1}\n\n";
    assert_eq!(settle(&total_tokens(), &h, stream), units(8));
    let bad_last =
        b"data: {\"usage\":{\"total_tokens\":5}}\n\ndata: {\"usage\":{\"total_tokens\":\"8\"}}\n\n";
    assert_eq!(
        settle(&total_tokens(), &h, bad_last),
        Err(Unsettled::Malformed)
    );
}

#[test]
fn an_event_too_large_after_the_usage_may_have_held_newer_usage() {
    let h = headers(&[SSE]);
    let big = format!("data: {}\n\n", "x".repeat(100));
    let usage = "data: {\"usage\":{\"total_tokens\":5}}\n\n";
    let before = format!("{big}{usage}");
    assert_eq!(
        settle_cut(&total_tokens(), 64, &h, before.as_bytes(), &[]),
        units(5)
    );
    let after = format!("{usage}{big}");
    assert_eq!(
        settle_cut(&total_tokens(), 64, &h, after.as_bytes(), &[]),
        Err(Unsettled::TooLarge)
    );
}

#[test]
fn a_usage_header_needs_no_body() {
    let settle_header = amount(r#"{"header": "x-usage-total-tokens", "times": 2}"#);
    let h = headers(&[JSON, ("x-usage-total-tokens", "42")]);
    let scanner = scan_one(&settle_header, MIB, &h);
    assert!(!scanner.wants_body());
    assert_eq!(one(scanner), units(84));
    let missing = scan_one(&settle_header, MIB, &headers(&[JSON]));
    assert_eq!(one(missing), Err(Unsettled::NoUsage));
    for bad in ["-1", "lots", "1e400", "99999999999999"] {
        let h = headers(&[("x-usage-total-tokens", bad)]);
        assert_eq!(
            one(scan_one(&settle_header, MIB, &h)),
            Err(Unsettled::Malformed),
            "{bad}"
        );
    }
    // A header part that failed decides the outcome before any body is read.
    let mixed = amount(r#"{"sum": [{"json": "usage.total_tokens"}, {"header": "x-extra"}]}"#);
    let scanner = scan_one(&mixed, MIB, &headers(&[JSON]));
    assert!(!scanner.wants_body());
    assert_eq!(one(scanner), Err(Unsettled::NoUsage));
    let with_fixed = amount(r#"{"sum": [{"json": "usage.total_tokens"}, {"value": 0.5}]}"#);
    assert_eq!(
        settle(&with_fixed, &headers(&[JSON]), OPENAI_JSON.as_bytes()),
        Ok(Millionths(21_500_000))
    );
}

#[test]
fn bad_bodies_settle_as_unreadable_and_none_panics() {
    let h = headers(&[JSON]);
    for (body, want) in [
        (&b"not json"[..], Unsettled::Malformed),
        (b"{\"usage\": {\"total_tokens\": 21}", Unsettled::Malformed),
        (
            b"{\"usage\": {\"total_tokens\": NaN}}",
            Unsettled::Malformed,
        ),
        (b"{\"usage\": {\"total_tokens\": -3}}", Unsettled::Malformed),
        (
            b"{\"usage\": {\"total_tokens\": 1e300}}",
            Unsettled::Malformed,
        ),
        (
            b"{\"usage\": {\"total_tokens\": 123456789012345678901234567890}}",
            Unsettled::Malformed,
        ),
        (
            b"{\"usage\": {\"total_tokens\": 9007199255}}",
            Unsettled::Malformed,
        ),
        (
            b"{\"usage\": {\"total_tokens\": {\"n\": 1}}}",
            Unsettled::Malformed,
        ),
        (
            b"{\"usage\": {\"total_tokens\": [21]}}",
            Unsettled::Malformed,
        ),
        (
            b"{\"usage\": {\"total_tokens\": \"21\"}}",
            Unsettled::Malformed,
        ),
        (
            b"{\"error\": {\"message\": \"rate limited\"}}",
            Unsettled::NoUsage,
        ),
        (b"", Unsettled::NoUsage),
    ] {
        assert_eq!(
            settle(&total_tokens(), &h, body),
            Err(want),
            "{}",
            String::from_utf8_lossy(body)
        );
    }
    // The largest amount itself is fine.
    assert_eq!(
        settle(
            &total_tokens(),
            &h,
            b"{\"usage\": {\"total_tokens\": 9007199254}}"
        ),
        Ok(Millionths(9_007_199_254_000_000))
    );
    // A sum of parts each within bounds but together past them.
    let twice = amount(r#"{"sum": [{"json": "a"}, {"json": "a"}]}"#);
    assert_eq!(
        settle(&twice, &h, b"{\"a\": 9007199254}"),
        Err(Unsettled::Malformed)
    );
}

#[test]
fn a_body_past_the_bound_is_too_large_and_at_it_is_read() {
    let h = headers(&[JSON]);
    let body = OPENAI_JSON.as_bytes();
    assert_eq!(
        settle_cut(&total_tokens(), body.len(), &h, body, &[100]),
        units(21)
    );
    assert_eq!(
        settle_cut(&total_tokens(), body.len() - 1, &h, body, &[100]),
        Err(Unsettled::TooLarge)
    );
}

#[test]
fn the_json_buffer_never_grows_past_the_bound() {
    let max = 10_000;
    let mut scanner = scan_one(&total_tokens(), max, &headers(&[JSON]));
    let chunk = [b' '; 333];
    for _ in 0..max / chunk.len() {
        scanner.feed(&chunk);
    }
    scanner.feed(&chunk[..max % chunk.len()]);
    let Some(Tap::Plain(Sink {
        body: Body::Json(buf),
        ..
    })) = &scanner.tap
    else {
        panic!("still scanning: {scanner:?}")
    };
    assert_eq!(buf.len(), max);
    assert!(buf.capacity() <= max, "capacity {}", buf.capacity());
    scanner.feed(b" ");
    assert!(!scanner.wants_body(), "the buffer is dropped at the bound");
    assert_eq!(one(scanner), Err(Unsettled::TooLarge));
}

fn gzip(bytes: &[u8]) -> Vec<u8> {
    let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
    e.write_all(bytes).unwrap();
    e.finish().unwrap()
}

fn zlib(bytes: &[u8]) -> Vec<u8> {
    let mut e = flate2::write::ZlibEncoder::new(Vec::new(), flate2::Compression::default());
    e.write_all(bytes).unwrap();
    e.finish().unwrap()
}

fn raw_deflate(bytes: &[u8]) -> Vec<u8> {
    let mut e = flate2::write::DeflateEncoder::new(Vec::new(), flate2::Compression::default());
    e.write_all(bytes).unwrap();
    e.finish().unwrap()
}

fn br(bytes: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    {
        let mut e = brotli::CompressorWriter::new(&mut out, 4096, 5, 22);
        e.write_all(bytes).unwrap();
    }
    out
}

fn zstd(bytes: &[u8]) -> Vec<u8> {
    zstd::stream::encode_all(bytes, 3).unwrap()
}

type Encoder = fn(&[u8]) -> Vec<u8>;

const ENCODINGS: [(&str, Encoder); 6] = [
    ("gzip", gzip),
    ("x-gzip", gzip),
    ("deflate", zlib),
    ("deflate", raw_deflate),
    ("br", br),
    ("zstd", zstd),
];

#[test]
fn compressed_bodies_are_decoded_for_scanning() {
    for (coding, encode) in ENCODINGS {
        let h = headers(&[JSON, ("content-encoding", coding)]);
        let body = encode(OPENAI_JSON.as_bytes());
        assert_eq!(
            settle_cut(&total_tokens(), MIB, &h, &body, &[1, 2, 3, 10]),
            units(21),
            "{coding}"
        );
        let h = headers(&[SSE, ("content-encoding", coding)]);
        let body = encode(ANTHROPIC_SSE.as_bytes());
        assert_eq!(
            settle_cut(&anthropic_tokens(), MIB, &h, &body, &[1, 7]),
            units(40),
            "{coding}"
        );
    }
    // Two gzip members, as a server flushing in pieces may send.
    let mut two = gzip(&OPENAI_JSON.as_bytes()[..50]);
    two.extend(gzip(&OPENAI_JSON.as_bytes()[50..]));
    let h = headers(&[JSON, ("content-encoding", "GZIP")]);
    assert_eq!(settle(&total_tokens(), &h, &two), units(21));
    // `identity` is no coding.
    let h = headers(&[JSON, ("content-encoding", "identity")]);
    assert_eq!(
        settle(&total_tokens(), &h, OPENAI_JSON.as_bytes()),
        units(21)
    );
}

#[test]
fn a_zip_bomb_stops_at_the_bound() {
    let zeros = vec![b' '; 64 * MIB];
    for (coding, encode) in ENCODINGS {
        let body = encode(&zeros);
        assert!(body.len() < MIB, "{coding}: {}", body.len());
        let h = headers(&[JSON, ("content-encoding", coding)]);
        assert_eq!(
            settle_cut(&total_tokens(), MIB, &h, &body, &[1000]),
            Err(Unsettled::TooLarge),
            "{coding}"
        );
    }
}

#[test]
fn broken_compression_and_unknown_codings() {
    let h = headers(&[JSON, ("content-encoding", "gzip")]);
    let mut corrupt = gzip(OPENAI_JSON.as_bytes());
    let mid = corrupt.len() / 2;
    corrupt[mid] ^= 0xFF;
    corrupt[mid + 1] ^= 0xFF;
    assert_eq!(
        settle(&total_tokens(), &h, &corrupt),
        Err(Unsettled::Malformed)
    );
    assert_eq!(
        settle(&total_tokens(), &h, b"plainly not gzip"),
        Err(Unsettled::Malformed)
    );
    for (coding, encode) in ENCODINGS {
        let body = encode(OPENAI_JSON.as_bytes());
        let h = headers(&[JSON, ("content-encoding", coding)]);
        let cut = &body[..body.len() / 2];
        assert_eq!(
            settle(&total_tokens(), &h, cut),
            Err(Unsettled::Malformed),
            "{coding} cut short"
        );
    }
    let h = headers(&[JSON, ("content-encoding", "deflate")]);
    assert_eq!(
        settle(&total_tokens(), &h, &[0x78]),
        Err(Unsettled::Malformed)
    );
    assert_eq!(settle(&total_tokens(), &h, b""), Err(Unsettled::NoUsage));
    for coding in ["compress", "gzip, br", "snappy"] {
        let h = headers(&[JSON, ("content-encoding", coding)]);
        let scanner = scan_one(&total_tokens(), MIB, &h);
        assert!(!scanner.wants_body(), "{coding}");
        assert_eq!(one(scanner), Err(Unsettled::Encoding), "{coding}");
    }
    let h = headers(&[
        JSON,
        ("content-encoding", "gzip"),
        ("content-encoding", "br"),
    ]);
    assert_eq!(settle(&total_tokens(), &h, b""), Err(Unsettled::Encoding));
}

#[test]
fn streams_split_at_every_byte_boundary_settle_the_same() {
    let every: Vec<usize> = (0..ANTHROPIC_SSE.len()).collect();
    let h = headers(&[SSE]);
    assert_eq!(
        settle_cut(
            &anthropic_tokens(),
            MIB,
            &h,
            ANTHROPIC_SSE.as_bytes(),
            &every
        ),
        units(40)
    );
    let every: Vec<usize> = (0..OPENAI_SSE.len()).collect();
    assert_eq!(
        settle_cut(&total_tokens(), MIB, &h, OPENAI_SSE.as_bytes(), &every),
        units(11)
    );
    let body = gzip(OPENAI_SSE.as_bytes());
    let every: Vec<usize> = (0..body.len()).collect();
    let h = headers(&[SSE, ("content-encoding", "gzip")]);
    assert_eq!(
        settle_cut(&total_tokens(), MIB, &h, &body, &every),
        units(11)
    );
}

proptest! {
    /// Any cuts, any number of them, in plain or compressed streams: the same settlement.
    #[test]
    fn cuts_change_nothing(
        mut cuts in proptest::collection::vec(0usize..3000, 0..12),
        coding in 0usize..ENCODINGS.len() + 1,
    ) {
        cuts.sort_unstable();
        let (name, body) = match ENCODINGS.get(coding) {
            Some((name, encode)) => (*name, encode(ANTHROPIC_SSE.as_bytes())),
            None => ("identity", ANTHROPIC_SSE.as_bytes().to_vec()),
        };
        let h = headers(&[SSE, ("content-encoding", name)]);
        prop_assert_eq!(settle_cut(&anthropic_tokens(), MIB, &h, &body, &cuts), units(40));
    }

    /// Whatever a member sends, under any content type and coding: an outcome, never a panic,
    /// and never more kept than the bound.
    #[test]
    fn any_answer_settles_or_is_unsettled(
        body in proptest::collection::vec(any::<u8>(), 0..512),
        cuts in proptest::collection::vec(0usize..512, 0..6),
        sse in any::<bool>(),
        coding in 0usize..ENCODINGS.len() + 1,
        max in 1usize..256,
    ) {
        let mut cuts = cuts;
        cuts.sort_unstable();
        let name = ENCODINGS.get(coding).map_or("identity", |(n, _)| *n);
        let kind = if sse { SSE } else { JSON };
        let h = headers(&[kind, ("content-encoding", name)]);
        let got = settle_cut(&usd(), max, &h, &body, &cuts);
        if let Ok(m) = got {
            prop_assert!(m <= Millionths::MAX);
        }
    }

    /// Events made of usage chunks and noise, with the usage anywhere: the last one counts.
    #[test]
    fn the_last_usage_counts_wherever_it_is(
        usages in proptest::collection::vec(0u64..1_000_000, 1..5),
        noise in proptest::collection::vec(0usize..3, 0..6),
        crlf in any::<bool>(),
    ) {
        let eol = if crlf { "\r\n" } else { "\n" };
        let mut stream = String::new();
        for (i, u) in usages.iter().enumerate() {
            for _ in 0..noise.get(i).copied().unwrap_or(0) {
                stream.push_str(&format!(": keepalive{eol}event: x{eol}data: {{\"delta\":\"hi\"}}{eol}{eol}"));
            }
            stream.push_str(&format!("data: {{\"usage\":{eol}data: {{\"total_tokens\":{u}}}}}{eol}{eol}"));
        }
        stream.push_str(&format!("data: [DONE]{eol}{eol}"));
        let h = headers(&[SSE]);
        let every: Vec<usize> = (0..stream.len()).collect();
        let last = *usages.last().unwrap();
        prop_assert_eq!(settle_cut(&total_tokens(), MIB, &h, stream.as_bytes(), &every), units(last));
    }
}

#[test]
fn scanning_a_chunk_allocates_nothing() {
    // A long answer: many token chunks, then the usage chunk, as OpenAI streams it.
    // Token chunks of varied text, so that compressed bodies still span many chunks.
    let mut seed: u64 = 0x9E37_79B9_7F4A_7C15;
    let mut tokens = |n: usize| -> String {
        (0..n)
            .map(|_| {
                seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                format!(
                    "data: {{\"id\":\"chatcmpl-1\",\"object\":\"chat.completion.chunk\",\"choices\":[{{\"index\":0,\"delta\":{{\"content\":\" {:016x}\"}},\"finish_reason\":null}}],\"usage\":null}}\n\n",
                    seed
                )
            })
            .collect()
    };
    let usage = "data: {\"id\":\"chatcmpl-1\",\"choices\":[],\"usage\":{\"prompt_tokens\":9,\"completion_tokens\":2000,\"total_tokens\":2009}}\n\ndata: [DONE]\n\n";
    let stream = format!("{}{usage}{}{usage}", tokens(200), tokens(2000));
    let json = format!(
        "{{\"pad\": {:?}, \"usage\": {{\"total_tokens\": 2009}}}}",
        tokens(1500)
    );
    let plain: Encoder = |b| b.to_vec();
    for (coding, encode) in std::iter::once(("identity", plain)).chain(ENCODINGS) {
        for (kind, body) in [(SSE, &stream), (JSON, &json)] {
            let body = encode(body.as_bytes());
            let h = headers(&[kind, ("content-encoding", coding)]);
            let mut scanner = scan_one(&total_tokens(), MIB, &h);
            // Small chunks, as a stream's tokens arrive.
            let mut chunks = body.chunks(64);
            // Decoders set up their state on first use, and the buffer grows to the body.
            let warm = chunks.len() / 3;
            for chunk in chunks.by_ref().take(warm) {
                scanner.feed(chunk);
            }
            let counted = chunks.len() as u64;
            let n = crate::alloc_count::allocations_in(|| chunks.for_each(|c| scanner.feed(c)));
            if kind == JSON {
                // The JSON buffer still grows, by doubling: a few allocations in all.
                assert!(n <= 8, "{coding} json: {n} allocations in {counted} chunks");
            } else if coding == "br" || coding == "zstd" {
                // Brotli allocates its tables per meta-block, and zstd now and then, each
                // spanning many chunks.
                assert!(
                    n * 4 < counted,
                    "{coding} sse: {n} allocations in {counted} chunks"
                );
            } else {
                assert_eq!(n, 0, "{coding} sse: {n} allocations in {counted} chunks");
            }
            assert_eq!(one(scanner), units(2009), "{coding}");
        }
    }
}

/// zstd with a window of `2^log`, its size unknown to the frame, as a streaming server makes it.
fn zstd_window(bytes: &[u8], log: u32) -> Vec<u8> {
    use zstd::stream::raw::CParameter;
    let mut e = zstd::stream::write::Encoder::new(Vec::new(), 3).unwrap();
    e.set_parameter(CParameter::WindowLog(log)).unwrap();
    e.set_parameter(CParameter::ContentSizeFlag(false)).unwrap();
    let (a, b) = bytes.split_at(bytes.len() / 2);
    e.write_all(a).unwrap();
    e.flush().unwrap();
    e.write_all(b).unwrap();
    e.finish().unwrap()
}

#[test]
fn zstd_past_the_http_window_is_not_decoded() {
    let h = headers(&[JSON, ("content-encoding", "zstd")]);
    let body = OPENAI_JSON.as_bytes();
    assert_eq!(
        settle(&total_tokens(), &h, &zstd_window(body, 23)),
        units(21)
    );
    assert_eq!(
        settle(&total_tokens(), &h, &zstd_window(body, 24)),
        Err(Unsettled::Malformed)
    );
}

#[test]
fn a_route_s_units_settle_from_one_pass() {
    let credits = amount(r#"{"header": "x-credits-used"}"#);
    let units_of_route = [total_tokens(), usd(), credits];
    let h = headers(&[SSE, ("content-encoding", "gzip"), ("x-credits-used", "3")]);
    let body = gzip(OPENAI_SSE.as_bytes());
    let mut scanner = ResponseScanner::new(&units_of_route, MIB, &h);
    for chunk in body.chunks(7) {
        scanner.feed(chunk);
    }
    assert_eq!(
        scanner.finish(),
        [units(11), Ok(Millionths(23 + 20)), units(3)]
    );
}

#[test]
fn a_body_that_cannot_be_read_leaves_the_other_units_settled() {
    let credits = amount(r#"{"header": "x-credits-used"}"#);
    let both = [total_tokens(), credits.clone()];
    let h = headers(&[JSON, ("x-credits-used", "3")]);
    let mut scanner = ResponseScanner::new(&both, 10, &h);
    scanner.feed(OPENAI_JSON.as_bytes());
    assert_eq!(scanner.finish(), [Err(Unsettled::TooLarge), units(3)]);
    let h = headers(&[
        JSON,
        ("x-credits-used", "3"),
        ("content-encoding", "compress"),
    ]);
    let scanner = ResponseScanner::new(&both, MIB, &h);
    assert_eq!(scanner.finish(), [Err(Unsettled::Encoding), units(3)]);
    // A unit whose header is missing settles nothing; the body is still read for the others.
    let mixed = amount(r#"{"sum": [{"json": "usage.total_tokens"}, {"header": "x-extra"}]}"#);
    let h = headers(&[JSON]);
    let mut scanner = ResponseScanner::new(&[mixed, total_tokens()], MIB, &h);
    assert!(scanner.wants_body());
    scanner.feed(OPENAI_JSON.as_bytes());
    assert_eq!(scanner.finish(), [Err(Unsettled::NoUsage), units(21)]);
    // No unit reads the body: it is not fed at all.
    let scanner = ResponseScanner::new(&[credits], MIB, &headers(&[JSON]));
    assert!(!scanner.wants_body());
    assert_eq!(scanner.finish(), [Err(Unsettled::NoUsage)]);
}

/// The gateway keeps a scanner in a request's context, across awaits and threads.
#[test]
fn a_scanner_can_live_in_a_request_context() {
    fn send_sync<T: Send + Sync>() {}
    send_sync::<ResponseScanner>();
    send_sync::<Amount>();
}

#[test]
fn unreadable_usage_events_split_at_every_byte_boundary_settle_as_malformed() {
    let h = headers(&[SSE]);
    for usage in [
        "{\"usage\":{\"total_tokens\":NaN}}",
        "{\"usage\":{\"total_tokens\":-5}}",
        "{\"usage\":{\"total_tokens\":{\"n\":5}}}",
        "{\"usage\":{\"total_tokens\":\"5\"}}",
        "{\"usage\":{\"total_tokens\":1e300}}",
        "{\"usage\":{\"total_tokens\":99999999999999999999999}}",
        "{\"usage\":{\"total_tokens\":5}",
    ] {
        let stream = format!(
            "data: {{\"usage\":{{\"total_tokens\":5}}}}\n\ndata: {usage}\n\ndata: [DONE]\n\n"
        );
        let every: Vec<usize> = (0..stream.len()).collect();
        assert_eq!(
            settle_cut(&total_tokens(), MIB, &h, stream.as_bytes(), &every),
            Err(Unsettled::Malformed),
            "{usage}"
        );
    }
}
