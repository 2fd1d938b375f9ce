//! A route's usage units, made ready to apply: their amounts as `sluice-usage` computes them,
//! and the request side of a reservation, the body read before admission.
//!
//! Reading the body is the one place a request waits on its client before admission, so it is
//! bounded and never fails the request: what cannot be read whole within the bound takes each
//! `json` part's default. The bytes read stay in Pingora's replay buffer, which Pingora sends
//! to the member before anything else of the body, so the member gets the body unchanged.

use std::sync::Arc;

use bytes::{Bytes, BytesMut};
use http::header;
use pingora::protocols::http::ServerSession;
use sluice_usage::{Amount, Millionths};

use crate::config::UsageConfig;

/// A route's `quota.usage`, ready to apply.
pub struct RouteUsage {
    /// The units, in the order written.
    pub units: Vec<Unit>,
    /// Bytes of a request body read before admission, at most.
    pub max_request_body: usize,
    /// Whether some reservation reads the request body.
    pub reads_body: bool,
    /// What each unit settles from, in the order of `units`, as a scanner takes them.
    pub settles: Vec<Amount>,
    /// Bytes of an answer's body kept for reading its amount, at most.
    pub max_response_body: usize,
    /// Statuses of an answer that did no work: the request settles to 0.
    pub zero_on: Vec<u16>,
}

/// One unit: what a request reserves in it, and what its answer settles.
pub struct Unit {
    /// The name windows count it by.
    pub name: Arc<str>,
    /// Charged at admission.
    pub reserve: Amount,
    /// What the request's entry becomes when the answer ends.
    pub settle: Amount,
}

impl RouteUsage {
    /// `usage` of a route's quota.
    pub fn build(usage: &UsageConfig) -> RouteUsage {
        RouteUsage {
            units: usage
                .units
                .iter()
                .map(|u| Unit {
                    name: u.name.0.clone(),
                    reserve: Amount::from(&u.reserve),
                    settle: Amount::from(&u.settle),
                })
                .collect(),
            max_request_body: usize::try_from(usage.max_request_body.get()).unwrap_or(usize::MAX),
            reads_body: usage.reads_request_body(),
            settles: usage
                .units
                .iter()
                .map(|u| Amount::from(&u.settle))
                .collect(),
            max_response_body: usize::try_from(usage.max_response_body.get()).unwrap_or(usize::MAX),
            zero_on: usage.zero_on.clone(),
        }
    }

    /// What `request` reserves in each unit, in the order of [`RouteUsage::units`].
    pub fn reserve(&self, request: &sluice_usage::Request<'_>) -> Vec<Millionths> {
        self.units
            .iter()
            .map(|u| sluice_usage::reserve(&u.reserve, request))
            .collect()
    }
}

/// What was read of a request's body before admission.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Prefix {
    /// The whole body, when it was read: no larger than the bound, framed by
    /// `Content-Length`, not content-encoded, not held back for `100 Continue`.
    pub body: Option<Bytes>,
    /// The body's length for `request_bytes`: its `Content-Length` (0 for a chunked body,
    /// whose length is not known before it ends).
    pub len: u64,
}

impl Prefix {
    /// A body left unread, with the length its head gives.
    pub(crate) fn unread(headers: &http::HeaderMap) -> Prefix {
        Prefix {
            body: None,
            len: framing(headers).0,
        }
    }

    /// The request as `sluice-usage` reserves from it.
    pub fn request<'a>(&'a self, headers: &'a http::HeaderMap) -> sluice_usage::Request<'a> {
        sluice_usage::Request {
            body: self.body.as_deref(),
            body_len: self.len,
            headers,
        }
    }
}

/// Reads the body of the request in `session` before admission, when it is whole within
/// `bound` bytes; otherwise reads nothing, and the reservation takes its defaults.
///
/// Not read:
/// - a body larger than `bound`, or chunked: reading part of it would hold the client for
///   nothing, as a prefix is not JSON;
/// - a content-encoded body, which is not JSON as it stands;
/// - a request with `Expect: 100-continue`: its client waits for the member's `100 Continue`
///   before it sends the body, and answering it here would ask for a body that admission may
///   then refuse.
///
/// What is read stays in the session's replay buffer, which Pingora sends to the member first
/// (and again on a replay), so the member gets every byte as the client sent it. A body that
/// cannot be read whole (the client hangs up or stalls mid-body) is the error, returned before
/// anything is charged: Pingora's reader counts such a body as finished, so a request let
/// through would be charged and go to its member cut short.
pub(crate) async fn read_prefix(
    session: &mut ServerSession,
    bound: usize,
) -> pingora::Result<Prefix> {
    let headers = &session.req_header().headers;
    let (len, length) = framing(headers);
    let chunked = headers.contains_key(header::TRANSFER_ENCODING);
    let encoded = headers
        .get(header::CONTENT_ENCODING)
        .is_some_and(|v| !v.as_bytes().eq_ignore_ascii_case(b"identity"));
    let expects_continue = headers
        .get(header::EXPECT)
        .is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"100-continue"));
    let Some(length) = length else {
        // No framing at all is no body.
        let body = (!chunked).then(Bytes::new);
        return Ok(Prefix { body, len });
    };
    let within = usize::try_from(length).is_ok_and(|l| l <= bound);
    if !within || encoded || expects_continue {
        return Ok(Prefix { body: None, len });
    }
    if length == 0 {
        return Ok(Prefix {
            body: Some(Bytes::new()),
            len,
        });
    }
    // Before the first read, so that every byte read is kept for the member.
    session.enable_retry_buffering();
    let mut body = BytesMut::with_capacity(usize::try_from(length).unwrap_or(0));
    // The client's side failed: a closed connection is answered with nothing, a timeout with a
    // 400 (`answer::failure`), as for any body Pingora reads.
    while let Some(chunk) = session
        .read_request_body()
        .await
        .map_err(|e| e.into_down())?
    {
        body.extend_from_slice(&chunk);
    }
    Ok(Prefix {
        body: Some(body.freeze()),
        len,
    })
}

/// The body's length for `request_bytes` (0 when chunked or absent), and its
/// `Content-Length` when that frames it.
fn framing(headers: &http::HeaderMap) -> (u64, Option<u64>) {
    if headers.contains_key(header::TRANSFER_ENCODING) {
        // Chunked framing wins over any Content-Length (RFC 9112 6.3).
        return (0, None);
    }
    // Reconciled as Pingora frames the body: a list of equal lengths is that length.
    let length = crate::headers::content_length(headers);
    (length.unwrap_or(0), length)
}

#[cfg(test)]
mod tests;
