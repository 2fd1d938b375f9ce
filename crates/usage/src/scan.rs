//! The settled amount, read from an answer as it streams by.
//!
//! The gateway makes a [`ResponseScanner`] from the response head and the `settle` amounts of
//! the route's units, feeds it each body chunk as the chunk passes on to the client unchanged,
//! and calls [`ResponseScanner::finish`] when the body ends, for one outcome per unit. All the
//! units share one pass: one decoder, one buffer. What it keeps is bounded by
//! `max_response_body`:
//! - a JSON body: its first `max_response_body` bytes; a longer one is
//!   [`Unsettled::TooLarge`];
//! - `text/event-stream`: one event's data, at most `max_response_body`, and the numbers read
//!   from earlier events. Each `json` part takes its number from the last event that holds its
//!   path (OpenAI's final usage chunk; Anthropic's `message_start` for input tokens and
//!   `message_delta` for output tokens); an event too large to read that comes after it makes
//!   the part [`Unsettled::TooLarge`], since it may have held a newer number;
//! - `header` parts are read from the head, and need no body at all.
//!
//! A body that cannot be read (too large, not decoded) leaves unsettled only the units that
//! read it; a unit whose header is missing does not stop the body being read for the others.
//!
//! A compressed body (`Content-Encoding` gzip, deflate, br or zstd) is decompressed for
//! scanning only (`decode.rs`), and the bound applies to the decompressed bytes: a zip
//! bomb stops at the bound.
//!
//! Each part is rounded up to the millionth on its own and the parts are summed; a sum past
//! [`Millionths::MAX`] is [`Unsettled::Malformed`].

use std::fmt;
use std::io::{self, Write};

use crate::amount::{Decimal, Millionths};
use crate::decode::Tap;
use crate::json::{lookup, Found};
use crate::spec::{Amount, Part};
use crate::sse::{Event, SseParser};

/// Why an answer settles nothing: the reservation stands. [`Unsettled::as_str`] is the
/// `reason` label of `sluice_usage_unsettled_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Unsettled {
    /// The body is not JSON, or the number at the path is negative, too large, or not a number
    /// (a string, an object, an array), or the compressed body does not decode.
    Malformed,
    /// The body (decompressed) is longer than `max_response_body`, or an SSE event that may
    /// hold the path is.
    TooLarge,
    /// The answer does not hold the path (or the header), and the part has no default.
    NoUsage,
    /// The body is compressed in a way this scanner does not decode.
    Encoding,
}

impl Unsettled {
    /// The metric label.
    pub fn as_str(&self) -> &'static str {
        match self {
            Unsettled::Malformed => "malformed",
            Unsettled::TooLarge => "too_large",
            Unsettled::NoUsage => "no_usage",
            Unsettled::Encoding => "encoding",
        }
    }
}

impl fmt::Display for Unsettled {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Reads what one answer settles in each of a route's units, in one pass over the body. See
/// the module documentation.
pub struct ResponseScanner {
    /// `None` when no amount needs the body, or once scanning it has failed.
    tap: Option<Tap<Sink>>,
    /// Per amount, per part: what the head already decided (`value`, `header`); `None` for a
    /// `json` part.
    heads: Vec<Vec<Option<Result<Millionths, Unsettled>>>>,
    amounts: Vec<Amount>,
    /// Why the body could not be read: the outcome of every amount that reads it.
    body_failed: Option<Unsettled>,
}

impl fmt::Debug for ResponseScanner {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ResponseScanner")
            .field("wants_body", &self.wants_body())
            .field("body_failed", &self.body_failed)
            .finish()
    }
}

/// What the head decides of each part of `amount`.
fn head_parts(
    amount: &Amount,
    headers: &http::HeaderMap,
) -> Vec<Option<Result<Millionths, Unsettled>>> {
    amount
        .parts()
        .iter()
        .map(|part| match part {
            Part::Json { .. } => None,
            Part::Value(value) => Some(Ok(value.to_millionths().unwrap_or(Millionths::MAX))),
            // A settlement has no request body; `check` refuses this part under `settle`.
            Part::RequestBytes { .. } => Some(Ok(Millionths::ZERO)),
            Part::Header { name, times } => Some(match headers.get(name.as_str()) {
                None => Err(Unsettled::NoUsage),
                Some(value) => value
                    .to_str()
                    .ok()
                    .and_then(Decimal::parse)
                    .and_then(|n| n.times(*times))
                    .ok_or(Unsettled::Malformed),
            }),
        })
        .collect()
}

/// The first part of an amount that the head decided against.
fn head_failure(head: &[Option<Result<Millionths, Unsettled>>]) -> Option<Unsettled> {
    head.iter().flatten().find_map(|r| r.err())
}

impl ResponseScanner {
    /// A scanner for an answer with `headers`, settling each of `amounts` (a route's units).
    pub fn new(
        amounts: &[Amount],
        max_response_body: usize,
        headers: &http::HeaderMap,
    ) -> ResponseScanner {
        let heads: Vec<_> = amounts.iter().map(|a| head_parts(a, headers)).collect();
        let mut scanner = ResponseScanner {
            tap: None,
            amounts: amounts.to_vec(),
            body_failed: None,
            heads,
        };
        // The body is read only for an amount it can still decide.
        let needs_body = amounts
            .iter()
            .zip(&scanner.heads)
            .any(|(a, head)| a.reads_body() && head_failure(head).is_none());
        if !needs_body {
            return scanner;
        }
        let sse = headers
            .get(http::header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.split(';').next())
            .is_some_and(|media| media.trim().eq_ignore_ascii_case("text/event-stream"));
        let sink = Sink::new(amounts, max_response_body, sse);
        match Tap::new(sink, headers) {
            Ok(tap) => scanner.tap = Some(tap),
            Err(_) => scanner.body_failed = Some(Unsettled::Encoding),
        }
        scanner
    }

    /// Whether the body is worth feeding: false when no amount reads it, or when the outcome
    /// is already decided.
    pub fn wants_body(&self) -> bool {
        self.tap.is_some()
    }

    /// Scans the body's next chunk, as the member sent it. Costs no allocation beyond the
    /// bounded buffer; once the outcome is decided, nothing.
    pub fn feed(&mut self, chunk: &[u8]) {
        let Some(tap) = &mut self.tap else { return };
        if tap.write_all(chunk).is_err() {
            self.body_failed = Some(tap.sink().failure());
            // Decoder and buffer go now, not when the response ends.
            self.tap = None;
        }
    }

    /// What the answer settles in each amount, in the order given, once the body has ended.
    pub fn finish(mut self) -> Vec<Result<Millionths, Unsettled>> {
        if let Some(tap) = &mut self.tap {
            if tap.finish().is_err() {
                self.body_failed = Some(tap.sink().failure());
            }
        }
        let sink = match self.body_failed {
            Some(reason) => Err(reason),
            // A tap that could not be made is `body_failed`; no tap and no failure means no
            // amount reads the body.
            None => self.tap.as_ref().map(Tap::sink).ok_or(Unsettled::NoUsage),
        };
        self.amounts
            .iter()
            .zip(&self.heads)
            .enumerate()
            .map(|(k, (amount, head))| {
                if let Some(reason) = head_failure(head) {
                    return Err(reason);
                }
                let mut total = Millionths::ZERO;
                for (i, (part, decided)) in amount.parts().iter().zip(head).enumerate() {
                    let value = match decided {
                        Some(decided) => *decided,
                        None => sink.and_then(|sink| sink.part_amount(k, i, part)),
                    }?;
                    total = total.checked_add(value).ok_or(Unsettled::Malformed)?;
                }
                Ok(total)
            })
            .collect()
    }
}

/// What an SSE event told of one `json` part.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Seen {
    Nothing,
    Amount(Millionths),
    Malformed,
}

/// A `json` part's state over an event stream.
#[derive(Debug, Clone, Copy)]
struct Slot {
    seen: Seen,
    /// An event too large to read came after `seen`.
    stale: bool,
}

enum Body {
    /// A JSON body's bytes so far.
    Json(Vec<u8>),
    /// An event stream: the parser, and per amount, per part, what the events told.
    Sse(SseParser, Vec<Vec<Slot>>),
}

/// Where the (decompressed) body goes.
struct Sink {
    amounts: Vec<Amount>,
    max: usize,
    body: Body,
    /// A JSON body outgrew the bound.
    too_large: bool,
    /// Bytes arrived at all.
    any: bool,
}

impl Sink {
    fn new(amounts: &[Amount], max: usize, sse: bool) -> Sink {
        let body = if sse {
            let unread = Slot {
                seen: Seen::Nothing,
                stale: false,
            };
            let slots = amounts
                .iter()
                .map(|a| vec![unread; a.parts().len()])
                .collect();
            Body::Sse(SseParser::new(max), slots)
        } else {
            Body::Json(Vec::new())
        };
        Sink {
            amounts: amounts.to_vec(),
            max,
            body,
            too_large: false,
            any: false,
        }
    }

    /// Why writing into this sink, or decoding into it, failed.
    fn failure(&self) -> Unsettled {
        if self.too_large {
            Unsettled::TooLarge
        } else {
            Unsettled::Malformed
        }
    }

    /// The amount of part `i` (a `json` part) of amount `k` read from the body.
    fn part_amount(&self, k: usize, i: usize, part: &Part) -> Result<Millionths, Unsettled> {
        let Part::Json {
            path,
            default,
            times,
        } = part
        else {
            return Err(Unsettled::NoUsage);
        };
        let found = match &self.body {
            Body::Json(_) if !self.any => Found::Absent,
            Body::Json(bytes) => lookup(bytes, path).map_err(|_| Unsettled::Malformed)?,
            Body::Sse(_, slots) => match slots[k][i] {
                Slot { stale: true, .. } => return Err(Unsettled::TooLarge),
                Slot {
                    seen: Seen::Amount(amount),
                    ..
                } => return Ok(amount),
                Slot {
                    seen: Seen::Malformed,
                    ..
                } => return Err(Unsettled::Malformed),
                Slot {
                    seen: Seen::Nothing,
                    ..
                } => Found::Absent,
            },
        };
        match found {
            Found::Number(n) => n.times(*times).ok_or(Unsettled::Malformed),
            Found::NotANumber => Err(Unsettled::Malformed),
            Found::Absent => match default {
                Some(d) => d.times(*times).ok_or(Unsettled::Malformed),
                None => Err(Unsettled::NoUsage),
            },
        }
    }
}

/// Updates what the events told each `json` part of each amount with one event.
fn on_event(amounts: &[Amount], slots: &mut [Vec<Slot>], event: Event<'_>) {
    let data = match event {
        Event::Oversized => {
            for slot in slots.iter_mut().flatten() {
                slot.stale = true;
            }
            return;
        }
        Event::Data(data) => data,
    };
    // Set once: a key written with escapes may hide from the search for its text.
    let escapes = memchr::memmem::find(data, b"\\u").is_some();
    for (amount, slots) in amounts.iter().zip(slots) {
        for (part, slot) in amount.parts().iter().zip(slots) {
            let Part::Json { path, times, .. } = part else {
                continue;
            };
            // Most events (each token of a stream) cannot hold the path: their text lacks its
            // last key.
            let names_key = memchr::memmem::find(data, path.last_key().as_bytes()).is_some();
            if !escapes && !names_key {
                continue;
            }
            let seen = match lookup(data, path) {
                Ok(Found::Number(n)) => n.times(*times).map_or(Seen::Malformed, Seen::Amount),
                Ok(Found::NotANumber) => Seen::Malformed,
                // An event that does not hold the path changes nothing.
                Ok(Found::Absent) => continue,
                // Not JSON, yet naming the key (`"total_tokens": NaN`): a usage event that
                // cannot be read. Other text (OpenAI's `[DONE]`) is passed over.
                Err(_) if names_key => Seen::Malformed,
                Err(_) => continue,
            };
            *slot = Slot { seen, stale: false };
        }
    }
}

impl Write for Sink {
    fn write(&mut self, bytes: &[u8]) -> io::Result<usize> {
        self.any |= !bytes.is_empty();
        match &mut self.body {
            Body::Json(buf) => {
                if buf.len() + bytes.len() > self.max {
                    self.too_large = true;
                    return Err(io::Error::other("body past max_response_body"));
                }
                if buf.capacity() < buf.len() + bytes.len() {
                    // Grow by doubling, but never past the bound.
                    let want = (buf.capacity() * 2)
                        .max(buf.len() + bytes.len())
                        .max(1024)
                        .min(self.max);
                    buf.reserve_exact(want - buf.len());
                }
                buf.extend_from_slice(bytes);
            }
            Body::Sse(parser, slots) => {
                let amounts = &self.amounts;
                parser.feed(bytes, |event| on_event(amounts, slots, event));
            }
        }
        Ok(bytes.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

#[cfg(test)]
mod tests;
