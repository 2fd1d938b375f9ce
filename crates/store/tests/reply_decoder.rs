//! The Redis client's reply decoder, as patched in third_party/redis ("complete replies
//! without combine", third_party/PATCHES.md): fed the same bytes in the same pieces, it
//! gives what the decoder as released gives (`ValueCodec::combine_only`): the same replies,
//! then the same error or the same wait for more, whatever the input.
//!
//! The same file holds the client's `Value::extract_error` to the walk it had as released ("no
//! rebuild of an error-free reply"): every reply passes through it after it is decoded.
//!
//! The decoder is the one every store call's reply goes through (the multiplexed connection
//! frames the socket with it), so the store suites on a real Redis exercise it end to end;
//! these properties cover the shapes and cuts a real server rarely produces.

use bytes::BytesMut;
use proptest::prelude::*;
use redis::{parse_redis_value, Value, ValueCodec};
use tokio_util::codec::Decoder;

/// A reply, as RESP2 bytes: the shapes the fast path reads (integers, bulk and simple strings,
/// nils, arrays, nested past its depth limit) and some it leaves to combine (errors, doubles,
/// RESP3 maps).
fn reply() -> impl Strategy<Value = Vec<u8>> {
    let leaf = prop_oneof![
        any::<i64>().prop_map(|n| format!(":{n}\r\n").into_bytes()),
        proptest::collection::vec(any::<u8>(), 0..40).prop_map(|body| {
            let mut out = format!("${}\r\n", body.len()).into_bytes();
            out.extend_from_slice(&body);
            out.extend_from_slice(b"\r\n");
            out
        }),
        Just(b"$-1\r\n".to_vec()),
        Just(b"*-1\r\n".to_vec()),
        Just(b"+OK\r\n".to_vec()),
        "[a-zA-Z0-9 :=]{0,12}".prop_map(|s| format!("+{s}\r\n").into_bytes()),
        "[A-Z]{1,8} [a-z ]{0,12}".prop_map(|s| format!("-{s}\r\n").into_bytes()),
        (-1000i32..1000).prop_map(|n| format!(",{n}.5\r\n").into_bytes()),
        Just(b"%1\r\n+k\r\n:1\r\n".to_vec()),
    ];
    leaf.prop_recursive(12, 64, 5, |inner| {
        proptest::collection::vec(inner, 0..5).prop_map(|items| {
            let mut out = format!("*{}\r\n", items.len()).into_bytes();
            for item in items {
                out.extend_from_slice(&item);
            }
            out
        })
    })
}

/// A decoder's reading of some input: each reply or error in order, then whether it was left
/// waiting for bytes that never came (`None` at the end).
type Reading = Vec<Option<Result<Value, String>>>;

/// What `codec` makes of `input` fed in pieces cut at `cuts`, then at its end. After an error
/// it reads on, as the multiplexed connection's read loop does.
fn decode_in_pieces(mut codec: ValueCodec, input: &[u8], cuts: &[usize]) -> Reading {
    let mut buf = BytesMut::new();
    let mut out = Vec::new();
    let mut points: Vec<usize> = cuts.iter().map(|c| c % (input.len() + 1)).collect();
    points.push(input.len());
    points.sort_unstable();
    let mut fed = 0;
    for point in points {
        buf.extend_from_slice(&input[fed..point]);
        fed = point;
        // Bounded: a decoder that fails without taking bytes would fail forever.
        for _ in 0..64 {
            match codec.decode(&mut buf) {
                Ok(Some(v)) => out.push(Some(Ok(v))),
                Ok(None) => break,
                Err(e) => out.push(Some(Err(e.to_string()))),
            }
        }
    }
    for _ in 0..64 {
        match codec.decode_eof(&mut buf) {
            Ok(Some(v)) => out.push(Some(Ok(v))),
            Ok(None) => {
                out.push(None);
                break;
            }
            Err(e) => out.push(Some(Err(e.to_string()))),
        }
    }
    out
}

/// The patched decoder's reading of `input`, which must equal the released one's.
fn both(input: &[u8], cuts: &[usize]) -> (Reading, Reading) {
    (
        decode_in_pieces(ValueCodec::default(), input, cuts),
        decode_in_pieces(ValueCodec::combine_only(), input, cuts),
    )
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    /// Replies back to back, cut anywhere: the same replies as released, each what the combine
    /// parser makes of its own bytes, and nothing left over or lost.
    #[test]
    fn replies_decode_as_released(
        replies in proptest::collection::vec(reply(), 1..4),
        cuts in proptest::collection::vec(any::<usize>(), 0..4),
    ) {
        let input: Vec<u8> = replies.concat();
        let (patched, released) = both(&input, &cuts);
        prop_assert_eq!(&patched, &released);
        let mut expected: Reading = replies
            .iter()
            .map(|r| Some(Ok(parse_redis_value(r).expect("a well-formed reply"))))
            .collect();
        expected.push(None);
        prop_assert_eq!(patched, expected);
    }

    /// A reply with one byte changed, then a good one, cut anywhere: the same replies and
    /// errors, in the same order, then the same wait, as released.
    #[test]
    fn damaged_replies_decode_as_released(
        reply in reply(),
        after in reply(),
        at in any::<usize>(),
        byte in prop_oneof![Just(b'\r'), Just(b'\n'), Just(b'-'), Just(b'9'), Just(b'*'), Just(b'$'), any::<u8>()],
        cuts in proptest::collection::vec(any::<usize>(), 0..3),
    ) {
        let mut input = reply.clone();
        let at = at % input.len();
        input[at] = byte;
        // A good reply behind the damaged one: what follows an error is read alike too.
        input.extend_from_slice(&after);
        let (patched, released) = both(&input, &cuts);
        prop_assert_eq!(patched, released);
    }

    /// Bytes of no particular shape: the same, as released.
    #[test]
    fn any_bytes_decode_as_released(
        input in proptest::collection::vec(
            prop_oneof![Just(b'\r'), Just(b'\n'), Just(b'*'), Just(b'$'), Just(b':'), Just(b'+'), Just(b'1'), Just(b'-'), any::<u8>()],
            0..48,
        ),
        cuts in proptest::collection::vec(any::<usize>(), 0..3),
    ) {
        let (patched, released) = both(&input, &cuts);
        prop_assert_eq!(patched, released);
    }
}

/// `Value::extract_error` as released: every collection rebuilt, element by element, and the
/// first server error met depth first returned.
fn extract_error_as_released(value: Value) -> Result<Value, String> {
    fn all(items: Vec<Value>) -> Result<Vec<Value>, String> {
        items.into_iter().map(extract_error_as_released).collect()
    }
    fn pairs(items: Vec<(Value, Value)>) -> Result<Vec<(Value, Value)>, String> {
        items
            .into_iter()
            .map(|(k, v)| Ok((extract_error_as_released(k)?, extract_error_as_released(v)?)))
            .collect()
    }
    Ok(match value {
        Value::Array(items) => Value::Array(all(items)?),
        Value::Set(items) => Value::Set(all(items)?),
        Value::Map(items) => Value::Map(pairs(items)?),
        Value::Attribute { data, attributes } => Value::Attribute {
            data: Box::new(extract_error_as_released(*data)?),
            attributes: pairs(attributes)?,
        },
        Value::Push { kind, data } => Value::Push {
            kind,
            data: all(data)?,
        },
        Value::ServerError(e) => return Err(redis::RedisError::from(e).to_string()),
        other => other,
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    /// Any reply, errors nested anywhere in it included: what `extract_error` gives is what it
    /// gave as released, the same value or the same error.
    #[test]
    fn errors_are_extracted_as_released(reply in reply()) {
        let value = parse_redis_value(&reply).expect("a well-formed reply");
        let patched = value.clone().extract_error().map_err(|e| e.to_string());
        prop_assert_eq!(patched, extract_error_as_released(value));
    }
}

/// An error deep in a reply is still found, and the first of two is the one returned; a reply
/// with none comes back as it was.
#[test]
fn a_nested_error_is_found() {
    let with_two = parse_redis_value(b"*3\r\n:1\r\n*2\r\n:2\r\n-ERR first\r\n-ERR second\r\n")
        .expect("a well-formed reply");
    let err = with_two.extract_error().expect_err("an error inside");
    assert!(err.to_string().contains("first"), "{err}");
    let clean = parse_redis_value(b"*2\r\n:1\r\n*1\r\n$2\r\nok\r\n").expect("a well-formed reply");
    assert_eq!(clean.clone().extract_error().expect("no error"), clean);
}

/// The reply shapes sluice's scripts return, and the edges of the fast path, read exactly.
#[test]
fn the_shapes_sluice_reads() {
    let cases: &[(&[u8], Value)] = &[
        (b":1\r\n", Value::Int(1)),
        (b":-9223372036854775808\r\n", Value::Int(i64::MIN)),
        (b"$0\r\n\r\n", Value::BulkString(vec![])),
        (b"$4\r\na\r\nb\r\n", Value::BulkString(b"a\r\nb".to_vec())),
        (b"$-1\r\n", Value::Nil),
        (b"*-1\r\n", Value::Nil),
        (b"*0\r\n", Value::Array(vec![])),
        (b"+OK\r\n", Value::Okay),
        (b"+QUEUED\r\n", Value::SimpleString("QUEUED".into())),
        (
            b"*2\r\n:1\r\n$5\r\nkey-a\r\n",
            Value::Array(vec![Value::Int(1), Value::BulkString(b"key-a".to_vec())]),
        ),
        // Blanks around an integer: combine tolerates them, so they go to combine.
        (b": 7\r\n", Value::Int(7)),
    ];
    for (bytes, want) in cases {
        let (patched, released) = both(bytes, &[]);
        assert_eq!(patched, released, "{:?}", String::from_utf8_lossy(bytes));
        assert_eq!(
            patched,
            vec![Some(Ok(want.clone())), None],
            "{:?}",
            String::from_utf8_lossy(bytes)
        );
    }
}

/// Integers at the edges of what `str::parse::<i64>` takes, and lines that are almost
/// integers or almost lines: read as released, whether as a value or as combine's error. The
/// fast path reads a size, a count or an integer reply itself, so a reader that is lax about
/// signs, digits or overflow (one tried reading the bytes without `str::parse`) must fail here.
#[test]
fn integer_spellings_read_as_released() {
    let lines: &[&[u8]] = &[
        b"0",
        b"-0",
        b"+0",
        b"+5",
        b"-5",
        b"007",
        b"9223372036854775807",
        b"9223372036854775808",
        b"-9223372036854775808",
        b"-9223372036854775809",
        b"99999999999999999999",
        b"",
        b"-",
        b"+",
        b"--1",
        b"+-1",
        b"1-",
        b"1a",
        b"0x10",
        b"\xff1",
        b"1\r",
        b"\r1",
    ];
    for line in lines {
        for kind in [b':', b'$', b'*'] {
            let mut input = vec![kind];
            input.extend_from_slice(line);
            input.extend_from_slice(b"\r\n");
            // A body for a size or a count that asks for one, so that the reply can end.
            input.extend_from_slice(b":1\r\n");
            let (patched, released) = both(&input, &[]);
            assert_eq!(patched, released, "{:?}", String::from_utf8_lossy(&input));
        }
    }
}

/// A count larger than the bytes could hold is an incomplete reply, not an allocation of that
/// size: the patched decoder waits for more, as released.
#[test]
fn a_huge_count_is_an_incomplete_reply() {
    for input in [
        &b"*9223372036854775807\r\n:1\r\n"[..],
        b"$9223372036854775807\r\nab\r\n",
    ] {
        let (patched, released) = both(input, &[]);
        assert_eq!(patched, released);
        assert!(!patched.iter().any(|r| matches!(r, Some(Ok(_)))));
    }
}

/// The framed reader reads into whatever room its buffer has left, at least one byte. After a
/// run of replies that room is the buffer's tail, so the next reply would arrive cut, and a cut
/// reply goes to combine, which then reads it twice as slowly. Once a run's replies are all
/// read, the decoder gives the emptied buffer its room back: from the front of the same
/// allocation, with nothing copied.
#[test]
fn an_emptied_buffer_gets_its_room_back() {
    let reply = b"*3\r\n:1\r\n$5\r\nkey-a\r\n:1700000000000\r\n";
    let mut codec = ValueCodec::default();
    let mut buf = BytesMut::with_capacity(8 * 1024);
    let start = buf.as_ptr();
    while buf.capacity() - buf.len() >= 2 * reply.len() {
        buf.extend_from_slice(reply);
    }
    let mut replies = 0;
    while let Some(value) = codec.decode(&mut buf).expect("well-formed replies") {
        assert_eq!(value, parse_redis_value(reply).unwrap());
        replies += 1;
    }
    assert!(replies > 100, "{replies} replies fill the buffer");
    assert!(buf.is_empty());
    assert!(
        buf.capacity() >= 8 * 1024,
        "room for the next read: {} bytes",
        buf.capacity()
    );
    assert_eq!(buf.as_ptr(), start, "the same allocation, from its front");
}
