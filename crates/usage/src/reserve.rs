//! What a request reserves at admission, from the request alone.
//!
//! A reservation is never an error: whatever cannot be read (a body too large or not JSON, a
//! field missing, negative or not a number, a header missing) takes the part's `default`, or 0
//! without one. A number too large for an amount reserves [`Millionths::MAX`], which no window
//! admits, rather than letting an absurd request through on the default.

use crate::amount::{Decimal, Millionths};
use crate::json::{lookup, Found};
use crate::spec::{Amount, Part};

/// What the gateway knows of a request before admission.
#[derive(Debug, Clone, Copy)]
pub struct Request<'a> {
    /// The whole body, when it was read within `usage.max_request_body` and is not
    /// content-encoded; `None` otherwise (too large, cut short, never read).
    pub body: Option<&'a [u8]>,
    /// The body's length in bytes for `request_bytes`: its `Content-Length`, or the bytes read
    /// when the whole body was read.
    pub body_len: u64,
    /// The request's headers, for `header` parts.
    pub headers: &'a http::HeaderMap,
}

/// The reservation `amount` makes for `request`, at most [`Millionths::MAX`].
pub fn reserve(amount: &Amount, request: &Request<'_>) -> Millionths {
    amount.parts().iter().fold(Millionths::ZERO, |sum, part| {
        sum.saturating_add(reserve_part(part, request))
    })
}

fn reserve_part(part: &Part, request: &Request<'_>) -> Millionths {
    let (value, times) = match part {
        Part::Json {
            path,
            default,
            times,
        } => {
            let found = request.body.map(|body| lookup(body, path));
            match found {
                Some(Ok(Found::Number(n))) => (Some(n), *times),
                _ => (*default, *times),
            }
        }
        Part::Value(value) => (Some(*value), Decimal::ONE),
        Part::RequestBytes { times } => (Some(Decimal::from_u64(request.body_len)), *times),
        Part::Header { name, times } => {
            let value = request
                .headers
                .get(name.as_str())
                .and_then(|v| v.to_str().ok())
                .and_then(Decimal::parse);
            (value, *times)
        }
    };
    match value {
        Some(value) => value.times(times).unwrap_or(Millionths::MAX),
        None => Millionths::ZERO,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::spec::from_config_json;
    use proptest::prelude::*;

    /// The reservation of the contract's token example: the completion cap plus a quarter of
    /// the request's bytes as a prompt estimate.
    fn tokens() -> Amount {
        from_config_json(
            r#"{"sum": [{"json": "max_tokens", "default": 4096}, {"request_bytes": true, "times": 0.25}]}"#,
        )
    }

    fn request<'a>(body: Option<&'a [u8]>, headers: &'a http::HeaderMap) -> Request<'a> {
        Request {
            body,
            body_len: body.map_or(0, |b| b.len() as u64),
            headers,
        }
    }

    #[test]
    fn reads_the_field_and_adds_the_estimate() {
        let h = http::HeaderMap::new();
        let body = br#"{"model":"gpt-4o-mini","max_tokens":100,"messages":[{"role":"user","content":"hi"}]}"#;
        let estimate = (body.len() as u64 * 1_000_000).div_ceil(4);
        assert_eq!(
            reserve(&tokens(), &request(Some(body), &h)),
            Millionths(100_000_000 + estimate)
        );
    }

    #[test]
    fn what_cannot_be_read_takes_the_default() {
        let h = http::HeaderMap::new();
        for body in [
            &br#"{"max_tokens":-5}"#[..],
            br#"{"max_tokens":"100"}"#,
            br#"{"max_tokens":{"n":1}}"#,
            br#"{"model":"x"}"#,
            b"not json",
            br#"{"max_tokens":100"#,
        ] {
            let estimate = (body.len() as u64 * 1_000_000).div_ceil(4);
            assert_eq!(
                reserve(&tokens(), &request(Some(body), &h)),
                Millionths(4_096_000_000 + estimate),
                "{}",
                String::from_utf8_lossy(body)
            );
        }
        // A body too large to read: the default, and the length the gateway counted.
        let big = Request {
            body: None,
            body_len: 1_000_000,
            headers: &h,
        };
        assert_eq!(
            reserve(&tokens(), &big),
            Millionths(4_096_000_000 + 250_000_000_000)
        );
    }

    #[test]
    fn an_absurd_field_reserves_the_most_not_the_default() {
        let h = http::HeaderMap::new();
        let body = br#"{"max_tokens":1e30}"#;
        assert_eq!(
            reserve(&tokens(), &request(Some(body), &h)),
            Millionths::MAX
        );
    }

    #[test]
    fn fixed_values_headers_and_missing_defaults() {
        let mut h = http::HeaderMap::new();
        h.insert("x-estimate", "12.5".parse().unwrap());
        let fixed = from_config_json(r#"{"value": 0.10}"#);
        assert_eq!(reserve(&fixed, &request(None, &h)), Millionths(100_000));
        let header = from_config_json(r#"{"header": "X-Estimate", "times": 2}"#);
        assert_eq!(reserve(&header, &request(None, &h)), Millionths(25_000_000));
        let missing = from_config_json(r#"{"header": "x-other"}"#);
        assert_eq!(reserve(&missing, &request(None, &h)), Millionths::ZERO);
        let no_default = from_config_json(r#"{"json": "max_tokens"}"#);
        assert_eq!(
            reserve(&no_default, &request(Some(b"{}"), &h)),
            Millionths::ZERO
        );
    }

    proptest! {
        /// Any bytes at all: a reservation, never a panic.
        #[test]
        fn any_body_reserves_something(body in proptest::collection::vec(any::<u8>(), 0..256)) {
            let h = http::HeaderMap::new();
            let got = reserve(&tokens(), &request(Some(&body), &h));
            prop_assert!(got <= Millionths::MAX);
        }
    }
}
