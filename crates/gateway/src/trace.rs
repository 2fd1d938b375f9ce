//! Request ids and W3C trace context: what links one request across the
//! client, sluice's access line, the member and a tracing backend.
//!
//! - `X-Request-Id`: the client's own when it is sane ([`request_id`]), else a new random
//!   one; sent to the member, returned to the client, logged.
//! - `traceparent` (W3C Trace Context level 1): a valid incoming one keeps its trace id and
//!   flags, and sluice's hop becomes a span of its own, whose id the member gets as its
//!   parent id. An absent or invalid one starts a new trace. `tracestate` is passed through
//!   untouched: sluice adds no entry of its own.
//!
//! Ids come from a thread-local generator ([`fastrand`], wyrand seeded from the OS): unique
//! enough for ids, cheap enough for every request, and not meant to be secret.

use http::HeaderValue;

/// Longest client `X-Request-Id` kept; longer ones are replaced (a log line is no place for a
/// kilobyte of client text).
pub const MAX_REQUEST_ID: usize = 128;

/// The request's id: the client's `X-Request-Id` when it is 1 to [`MAX_REQUEST_ID`] visible
/// ASCII characters, else 32 random hex digits.
pub fn request_id(incoming: Option<&HeaderValue>) -> HeaderValue {
    if let Some(v) = incoming {
        let b = v.as_bytes();
        if !b.is_empty() && b.len() <= MAX_REQUEST_ID && b.iter().all(|c| (0x21..=0x7e).contains(c))
        {
            return v.clone();
        }
    }
    let mut hex = [0u8; 32];
    hex_into(&mut hex, &fastrand::u128(..).to_be_bytes());
    // Owned by one shared allocation from the start: the id is cloned onto the member's head
    // and the client's answer, and a copied `Bytes` allocates again on its first clone.
    HeaderValue::from_maybe_shared(bytes::Bytes::from_owner(hex))
        .expect("hex digits are a valid header value")
}

/// A request's place in a trace.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TraceContext {
    /// The trace: the client's, or a new one.
    pub trace_id: [u8; 16],
    /// sluice's own span for this request: the member's parent.
    pub span_id: [u8; 8],
    /// The client's span, when it sent a valid `traceparent`.
    pub parent_id: Option<[u8; 8]>,
    /// The trace flags sent on: the client's, or for a new trace `01` (sampled) when sluice
    /// exports this request's span, `00` otherwise.
    pub flags: u8,
}

impl TraceContext {
    /// The request's trace context. A valid client `traceparent` is always continued: sluice's
    /// hop becomes a span of its own (logged, and exported when export is on). Without one, a
    /// new trace starts only when sluice exports spans (`exporting`), and `sample` decides
    /// whether it is sampled; otherwise sluice takes no part in tracing for this request, as a
    /// proxy with tracing off does (Envoy), and whatever the client sent under `traceparent`
    /// goes on untouched. Starting traces nobody collects would cost a header on every request
    /// and give the member a parent span that exists nowhere.
    pub fn of(
        incoming: Option<&HeaderValue>,
        exporting: bool,
        sample: impl FnOnce() -> bool,
    ) -> Option<TraceContext> {
        match incoming.and_then(|v| parse_traceparent(v.as_bytes())) {
            Some((trace_id, parent_id, flags)) => Some(TraceContext {
                trace_id,
                span_id: nonzero_span_id(),
                parent_id: Some(parent_id),
                flags,
            }),
            None if exporting => {
                let mut trace_id = fastrand::u128(..);
                if trace_id == 0 {
                    trace_id = 1;
                }
                Some(TraceContext {
                    trace_id: trace_id.to_be_bytes(),
                    span_id: nonzero_span_id(),
                    parent_id: None,
                    flags: u8::from(sample()),
                })
            }
            None => None,
        }
    }

    /// Whether the trace is sampled (flag bit 0).
    pub fn sampled(&self) -> bool {
        self.flags & 1 == 1
    }

    /// The `traceparent` the member gets: same trace and flags, sluice's span as parent.
    pub fn traceparent(&self) -> HeaderValue {
        let mut v = [0u8; 55];
        v[..3].copy_from_slice(b"00-");
        hex_into(&mut v[3..35], &self.trace_id);
        v[35] = b'-';
        hex_into(&mut v[36..52], &self.span_id);
        v[52] = b'-';
        hex_into(&mut v[53..55], &[self.flags]);
        HeaderValue::from_bytes(&v).expect("hex digits are a valid header value")
    }
}

fn nonzero_span_id() -> [u8; 8] {
    let mut id = fastrand::u64(..);
    if id == 0 {
        id = 1;
    }
    id.to_be_bytes()
}

/// Parses a `traceparent` as W3C Trace Context level 1 §3.2 says: version `00` exactly 55
/// bytes; a later version at least 55, with a `-` after the flags if longer (its extra fields
/// ignored); version `ff` invalid; lowercase hex only; all-zero trace or parent id invalid.
pub fn parse_traceparent(v: &[u8]) -> Option<([u8; 16], [u8; 8], u8)> {
    if v.len() < 55 || v[2] != b'-' || v[35] != b'-' || v[52] != b'-' {
        return None;
    }
    let mut version = [0u8; 1];
    unhex_into(&mut version, &v[..2])?;
    match version[0] {
        0xff => return None,
        0 if v.len() != 55 => return None,
        _ if v.len() > 55 && v[55] != b'-' => return None,
        _ => {}
    }
    let mut trace_id = [0u8; 16];
    let mut parent_id = [0u8; 8];
    let mut flags = [0u8; 1];
    unhex_into(&mut trace_id, &v[3..35])?;
    unhex_into(&mut parent_id, &v[36..52])?;
    unhex_into(&mut flags, &v[53..55])?;
    if trace_id == [0; 16] || parent_id == [0; 8] {
        return None;
    }
    Some((trace_id, parent_id, flags[0]))
}

/// Writes `bytes` as lowercase hex into `out`, which holds twice as many bytes.
pub fn hex_into(out: &mut [u8], bytes: &[u8]) {
    // Every caller sizes `out` from `bytes`: the length check cannot fail, and writes nothing
    // if it ever did.
    let _ = hex::encode_to_slice(bytes, out);
}

/// Reads lowercase hex (W3C forbids uppercase) into `out`.
fn unhex_into(out: &mut [u8], hex: &[u8]) -> Option<()> {
    fn digit(c: u8) -> Option<u8> {
        match c {
            b'0'..=b'9' => Some(c - b'0'),
            b'a'..=b'f' => Some(c - b'a' + 10),
            _ => None,
        }
    }
    for (o, pair) in out.iter_mut().zip(hex.chunks_exact(2)) {
        *o = digit(pair[0])? << 4 | digit(pair[1])?;
    }
    Some(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_valid_traceparent_keeps_its_trace_and_flags() {
        let tp = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        let cx = TraceContext::of(Some(&HeaderValue::from_static(tp)), false, || false)
            .expect("a valid traceparent is continued");
        assert_eq!(cx.trace_id[0], 0x4b);
        assert_eq!(cx.parent_id, Some(0x00f067aa0ba902b7u64.to_be_bytes()));
        assert!(cx.sampled());
        let out = cx.traceparent();
        let out = out.to_str().unwrap();
        assert!(out.starts_with("00-4bf92f3577b34da6a3ce929d0e0e4736-"));
        assert!(out.ends_with("-01"));
        assert_ne!(&out[36..52], "00f067aa0ba902b7");
        assert_eq!(
            parse_traceparent(out.as_bytes()).map(|p| p.1),
            Some(cx.span_id)
        );
    }

    #[test]
    fn invalid_traceparents_start_a_new_trace_only_when_exporting() {
        for bad in [
            "",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-0",
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra",
            "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01extra",
        ] {
            assert_eq!(parse_traceparent(bad.as_bytes()), None, "{bad}");
        }
        // A later version may carry more fields after a dash.
        assert!(
            parse_traceparent(b"01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-more")
                .is_some()
        );
        // Exporting, an invalid or absent one starts a new trace, sampled or not...
        let garbage = HeaderValue::from_static("garbage");
        let cx = TraceContext::of(Some(&garbage), true, || true).expect("a new trace");
        assert_eq!((cx.parent_id, cx.flags), (None, 1));
        let cx = TraceContext::of(None, true, || false).expect("a new trace");
        assert_eq!(cx.flags, 0);
        assert_ne!(cx.trace_id, [0; 16]);
        // ...and with export off, sluice starts none.
        assert_eq!(TraceContext::of(Some(&garbage), false, || true), None);
        assert_eq!(TraceContext::of(None, false, || true), None);
    }

    #[test]
    fn request_ids_are_kept_when_sane() {
        let sane = HeaderValue::from_static("abc-123_XYZ");
        assert_eq!(request_id(Some(&sane)), sane);
        let long = HeaderValue::from_str(&"a".repeat(MAX_REQUEST_ID + 1)).unwrap();
        for bad in [
            HeaderValue::from_static("has space"),
            HeaderValue::from_static(""),
            long,
        ] {
            let id = request_id(Some(&bad));
            assert_ne!(id, bad);
            assert_eq!(id.len(), 32);
            assert!(id.as_bytes().iter().all(u8::is_ascii_hexdigit));
        }
        assert_ne!(request_id(None), request_id(None));
    }
}
