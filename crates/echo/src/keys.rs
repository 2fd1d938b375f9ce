//! The echo server as a key-limited API stub: per-key sliding windows, per-key counters and
//! scripted refusals.
//!
//! A request's key is its `Authorization` value (missing: the empty key). The window is a log
//! of admitted requests per key, at the server's own monotonic clock; refused requests are not
//! counted in it, as an API that did no work for them would not count them either. Everything
//! here is decided under one lock and never across an `.await`.

use std::collections::{HashMap, VecDeque};
use std::time::Duration;

use tokio::time::Instant;

/// The policy name in the `RateLimit-Policy` and `RateLimit` fields the stub sends.
pub(crate) const POLICY: &str = "api";

/// A refusal scripted by [`crate::EchoServer::refuse_next`] or its RateLimit twin.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Scripted {
    /// 429 with exactly this `Retry-After` value.
    RetryAfter(String),
    /// 429 with exactly this `RateLimit` value and no `Retry-After`.
    RateLimit(String),
}

/// The window's state after admitting a request, for the stub's own RateLimit fields.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Quota {
    pub(crate) limit: u64,
    pub(crate) remaining: u64,
    /// Whole seconds until the oldest counted request leaves the window (at least 1).
    pub(crate) reset_secs: u64,
    /// The window's length in whole seconds (at least 1).
    pub(crate) window_secs: u64,
}

/// What to do with one request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Decision {
    /// Serve it; `Some` when the server is key-limited.
    Admit(Option<Quota>),
    /// Past the key's limit: `quota.reset_secs` is the Retry-After.
    OverLimit(Quota),
    /// A scripted refusal was waiting for this key.
    Scripted(Scripted),
}

#[derive(Debug, Default)]
struct Key {
    served: u64,
    refused: u64,
    /// Arrival times of the admitted requests still in the window, oldest first.
    admitted: VecDeque<Instant>,
    scripted: VecDeque<Scripted>,
}

/// Every key the server has seen.
#[derive(Debug)]
pub(crate) struct Keys {
    limit: Option<(u64, Duration)>,
    by_key: HashMap<String, Key>,
}

impl Keys {
    /// `limit` must have a non-zero count and window (checked by the caller).
    pub(crate) fn new(limit: Option<(u64, Duration)>) -> Keys {
        Keys {
            limit,
            by_key: HashMap::new(),
        }
    }

    fn key(&mut self, key: &str) -> &mut Key {
        if !self.by_key.contains_key(key) {
            self.by_key.insert(key.to_string(), Key::default());
        }
        self.by_key.get_mut(key).expect("just inserted")
    }

    /// Decides a request with `key` arriving at `now`, and counts it.
    pub(crate) fn decide(&mut self, key: &str, now: Instant) -> Decision {
        let limit = self.limit;
        let entry = self.key(key);
        if let Some(scripted) = entry.scripted.pop_front() {
            entry.refused += 1;
            return Decision::Scripted(scripted);
        }
        let Some((limit, window)) = limit else {
            entry.served += 1;
            return Decision::Admit(None);
        };
        while let Some(&oldest) = entry.admitted.front() {
            if now.saturating_duration_since(oldest) >= window {
                entry.admitted.pop_front();
            } else {
                break;
            }
        }
        let full = entry.admitted.len() as u64 >= limit;
        if !full {
            entry.admitted.push_back(now);
            entry.served += 1;
        } else {
            entry.refused += 1;
        }
        let oldest = *entry
            .admitted
            .front()
            .expect("a full or just-used window is not empty");
        let quota = Quota {
            limit,
            remaining: limit.saturating_sub(entry.admitted.len() as u64),
            reset_secs: ceil_secs((oldest + window).saturating_duration_since(now)).max(1),
            window_secs: ceil_secs(window).max(1),
        };
        if full {
            Decision::OverLimit(quota)
        } else {
            Decision::Admit(Some(quota))
        }
    }

    /// Counts a refusal that was decided elsewhere (the `x-force-429` header).
    pub(crate) fn count_refused(&mut self, key: &str) {
        self.key(key).refused += 1;
    }

    /// Queues `n` scripted refusals for `key`, after any already queued.
    pub(crate) fn script(&mut self, key: &str, n: u64, refusal: Scripted) {
        let entry = self.key(key);
        for _ in 0..n {
            entry.scripted.push_back(refusal.clone());
        }
    }

    pub(crate) fn served(&self, key: &str) -> u64 {
        self.by_key.get(key).map_or(0, |k| k.served)
    }

    pub(crate) fn refused(&self, key: &str) -> u64 {
        self.by_key.get(key).map_or(0, |k| k.refused)
    }

    /// `(key, served, refused)` for every key seen or scripted, sorted by key.
    pub(crate) fn snapshot(&self) -> Vec<(String, u64, u64)> {
        let mut all: Vec<_> = self
            .by_key
            .iter()
            .map(|(key, k)| (key.clone(), k.served, k.refused))
            .collect();
        all.sort();
        all
    }
}

/// The last four characters of `key`: enough to tell keys apart, not enough to use one.
pub(crate) fn key_hint(key: &str) -> String {
    let skip = key.chars().count().saturating_sub(4);
    key.chars().skip(skip).collect()
}

fn ceil_secs(d: Duration) -> u64 {
    d.as_secs() + u64::from(d.subsec_nanos() > 0)
}

/// Parses `LIMIT/WINDOW` as the command line gives it, e.g. `5/10s`, `100/1m`, `3/500ms`.
pub(crate) fn parse_key_limit(text: &str) -> Result<(u64, Duration), String> {
    let (limit, window) = text
        .split_once('/')
        .ok_or_else(|| format!("expected LIMIT/WINDOW such as 5/10s, got {text:?}"))?;
    let limit: u64 = limit
        .trim()
        .parse()
        .ok()
        .filter(|&n| n > 0)
        .ok_or_else(|| format!("the limit must be a positive integer, got {limit:?}"))?;
    let window = window.trim();
    let split = window
        .find(|c: char| !c.is_ascii_digit())
        .ok_or_else(|| format!("the window needs a unit (ms, s, m or h), got {window:?}"))?;
    let (number, unit) = window.split_at(split);
    let number: u64 = number
        .parse()
        .map_err(|_| format!("the window must start with a number, got {window:?}"))?;
    let millis = match unit {
        "ms" => Some(number),
        "s" => number.checked_mul(1_000),
        "m" => number.checked_mul(60_000),
        "h" => number.checked_mul(3_600_000),
        _ => return Err(format!("unknown window unit {unit:?}: use ms, s, m or h")),
    }
    .filter(|&ms| ms > 0)
    .ok_or_else(|| format!("the window must be positive and reasonable, got {window:?}"))?;
    Ok((limit, Duration::from_millis(millis)))
}

#[cfg(test)]
mod tests {
    use super::*;

    const MINUTE: Duration = Duration::from_secs(60);

    fn quota(d: &Decision) -> Quota {
        match d {
            Decision::Admit(Some(q)) | Decision::OverLimit(q) => *q,
            other => panic!("no quota in {other:?}"),
        }
    }

    #[test]
    fn a_sliding_window_per_key_at_explicit_instants() {
        let mut keys = Keys::new(Some((2, Duration::from_secs(10))));
        let t0 = Instant::now();
        let at = |ms: u64| t0 + Duration::from_millis(ms);

        let first = keys.decide("a", at(0));
        assert!(matches!(first, Decision::Admit(Some(_))));
        assert_eq!(
            quota(&first),
            Quota {
                limit: 2,
                remaining: 1,
                reset_secs: 10,
                window_secs: 10
            }
        );
        assert_eq!(quota(&keys.decide("a", at(3_000))).remaining, 0);
        // Full: the oldest leaves at 10 s, so at 4.5 s Retry-After is ceil(5.5) = 6.
        let over = keys.decide("a", at(4_500));
        assert!(matches!(over, Decision::OverLimit(_)), "{over:?}");
        assert_eq!(quota(&over).reset_secs, 6);
        // Another key has its own window.
        assert!(matches!(keys.decide("b", at(4_500)), Decision::Admit(_)));
        // Just before the oldest leaves: still refused, and never less than 1 s.
        assert_eq!(quota(&keys.decide("a", at(9_999))).reset_secs, 1);
        // At 10 s the first request has left; the refusals were never counted in the window.
        let back = keys.decide("a", at(10_000));
        assert!(matches!(back, Decision::Admit(_)), "{back:?}");
        assert_eq!(
            quota(&back).reset_secs,
            3,
            "the 3 s request is now the oldest"
        );

        assert_eq!((keys.served("a"), keys.refused("a")), (3, 2));
        assert_eq!(
            keys.snapshot(),
            vec![("a".to_string(), 3, 2), ("b".to_string(), 1, 0)]
        );
        assert_eq!((keys.served("never"), keys.refused("never")), (0, 0));
    }

    #[test]
    fn scripted_refusals_come_first_and_run_out() {
        let mut keys = Keys::new(Some((100, MINUTE)));
        let now = Instant::now();
        keys.script("k", 2, Scripted::RetryAfter("2".into()));
        keys.script("k", 1, Scripted::RateLimit("\"api\";r=0;t=7".into()));
        assert_eq!(
            keys.decide("k", now),
            Decision::Scripted(Scripted::RetryAfter("2".into()))
        );
        assert_eq!(
            keys.decide("k", now),
            Decision::Scripted(Scripted::RetryAfter("2".into()))
        );
        assert_eq!(
            keys.decide("k", now),
            Decision::Scripted(Scripted::RateLimit("\"api\";r=0;t=7".into()))
        );
        assert!(matches!(keys.decide("k", now), Decision::Admit(Some(_))));
        assert_eq!((keys.served("k"), keys.refused("k")), (1, 3));
    }

    #[test]
    fn without_a_limit_everything_is_admitted_and_counted() {
        let mut keys = Keys::new(None);
        for _ in 0..5 {
            assert_eq!(keys.decide("", Instant::now()), Decision::Admit(None));
        }
        keys.count_refused("");
        assert_eq!(keys.snapshot(), vec![(String::new(), 5, 1)]);
    }

    #[test]
    fn key_hints_are_the_last_four_characters() {
        assert_eq!(key_hint("Bearer demo-key-a"), "ey-a");
        assert_eq!(key_hint("abc"), "abc");
        assert_eq!(key_hint(""), "");
        assert_eq!(key_hint("Bearer ключ"), "ключ");
    }

    #[test]
    fn key_limits_parse_from_the_command_line() {
        assert_eq!(parse_key_limit("5/10s"), Ok((5, Duration::from_secs(10))));
        assert_eq!(parse_key_limit("100/1m"), Ok((100, MINUTE)));
        assert_eq!(
            parse_key_limit("3/500ms"),
            Ok((3, Duration::from_millis(500)))
        );
        assert_eq!(parse_key_limit("1/2h"), Ok((1, Duration::from_secs(7200))));
        for bad in [
            "", "5", "0/10s", "5/0s", "5/10", "5/10d", "x/10s", "5/s", "-1/10s",
        ] {
            assert!(parse_key_limit(bad).is_err(), "{bad:?} should not parse");
        }
    }
}
