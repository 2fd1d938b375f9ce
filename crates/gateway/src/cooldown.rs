//! Cooldowns learned from a member's own answers (SPEC §8): how long an API asked a key (or a
//! proxy) to be left alone.
//!
//! An API that answers 429 usually says when to come back, in one of two ways:
//! - `Retry-After` (RFC 9110 §10.2.3), as seconds or as an HTTP-date;
//! - the `RateLimit` field of draft-ietf-httpapi-ratelimit-headers: a policy whose remaining
//!   units `r` are 0 is exhausted until its reset `t` seconds from now.
//!
//! `Retry-After` wins, being the answer's own statement about this request; a `RateLimit` item
//! only describes a policy. When the answer says neither, the route's `default` applies, and
//! whatever it says is capped at `max`: a member that asks for ten days (or a date far in the
//! future) is not lost for ten days on one answer's word.
//!
//! The header parsing never fails loudly: a malformed value is ignored, like a missing one,
//! since it comes from a member sluice does not control.

use std::time::{Duration, SystemTime};

use http::{header, HeaderMap};

use crate::config::CooldownConfig;
use crate::headers::RATELIMIT;

/// How long to cool a member that answered `headers` with one of `on_status`, at `now`.
pub(crate) fn duration(config: &CooldownConfig, headers: &HeaderMap, now: SystemTime) -> Duration {
    hint(headers, now)
        .unwrap_or(config.default.0)
        .min(config.max.0)
}

/// What the answer itself says about when to come back, if anything.
pub(crate) fn hint(headers: &HeaderMap, now: SystemTime) -> Option<Duration> {
    retry_after(headers, now).or_else(|| exhausted_policy_reset(headers))
}

/// `Retry-After: <seconds>` or `Retry-After: <HTTP-date>`; a date in the past is "now".
fn retry_after(headers: &HeaderMap, now: SystemTime) -> Option<Duration> {
    let value = headers.get(header::RETRY_AFTER)?.to_str().ok()?.trim();
    if let Ok(seconds) = value.parse::<u64>() {
        return Some(Duration::from_secs(seconds));
    }
    let at = httpdate::parse_http_date(value).ok()?;
    Some(at.duration_since(now).unwrap_or(Duration::ZERO))
}

/// The longest reset `t` among the `RateLimit` items with no units left (`r=0`). Every field
/// line is read: a list may be split over several.
fn exhausted_policy_reset(headers: &HeaderMap) -> Option<Duration> {
    let mut longest: Option<u64> = None;
    for line in headers.get_all(RATELIMIT.name()) {
        let Ok(list) = sfv::Parser::new(line.as_bytes()).parse::<sfv::List>() else {
            continue;
        };
        for entry in list {
            let sfv::ListEntry::Item(item) = entry else {
                continue;
            };
            let param = |name: &str| {
                item.params
                    .iter()
                    .find(|(k, _)| k.as_str() == name)
                    .and_then(|(_, v)| v.as_integer())
                    .map(i64::from)
            };
            if param("r") == Some(0) {
                if let Some(t) = param("t").and_then(|t| u64::try_from(t).ok()) {
                    longest = Some(longest.map_or(t, |l| l.max(t)));
                }
            }
        }
    }
    longest.map(Duration::from_secs)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Dur;

    fn config() -> CooldownConfig {
        CooldownConfig {
            on_status: vec![429],
            default: Dur(Duration::from_secs(30)),
            max: Dur(Duration::from_secs(15 * 60)),
            retry: false,
        }
    }

    fn headers(pairs: &[(&str, &str)]) -> HeaderMap {
        let mut map = HeaderMap::new();
        for (name, value) in pairs {
            map.append(
                http::HeaderName::from_bytes(name.as_bytes()).unwrap(),
                value.parse().unwrap(),
            );
        }
        map
    }

    #[test]
    fn retry_after_seconds_and_dates() {
        let now = SystemTime::UNIX_EPOCH + Duration::from_secs(1_700_000_000);
        let c = config();
        assert_eq!(
            duration(&c, &headers(&[("retry-after", "2")]), now),
            Duration::from_secs(2)
        );
        let later = httpdate::fmt_http_date(now + Duration::from_secs(90));
        assert_eq!(
            duration(&c, &headers(&[("retry-after", &later)]), now),
            Duration::from_secs(90)
        );
        let past = httpdate::fmt_http_date(now - Duration::from_secs(90));
        assert_eq!(
            duration(&c, &headers(&[("retry-after", &past)]), now),
            Duration::ZERO
        );
    }

    #[test]
    fn long_asks_are_capped_and_silence_gets_the_default() {
        let now = SystemTime::now();
        let c = config();
        let ten_days = (10 * 86_400).to_string();
        assert_eq!(
            duration(&c, &headers(&[("retry-after", &ten_days)]), now),
            c.max.0
        );
        assert_eq!(duration(&c, &HeaderMap::new(), now), c.default.0);
        for junk in ["soon", "-5", "1.5", "Tue, 99 Foo 2026"] {
            assert_eq!(
                duration(&c, &headers(&[("retry-after", junk)]), now),
                c.default.0,
                "{junk}"
            );
        }
    }

    #[test]
    fn an_exhausted_ratelimit_policy_gives_its_reset() {
        let now = SystemTime::now();
        let c = config();
        let h = headers(&[
            ("ratelimit", r#""minute";r=3;t=20"#),
            ("ratelimit", r#""day";r=0;t=600, "hour";r=0;t=60"#),
        ]);
        assert_eq!(duration(&c, &h, now), Duration::from_secs(600));
        // Retry-After is the answer's own word, and wins.
        let mut both = h.clone();
        both.insert(header::RETRY_AFTER, "7".parse().unwrap());
        assert_eq!(duration(&c, &both, now), Duration::from_secs(7));
        // Not exhausted, malformed, or without a reset: the default.
        for value in [r#""m";r=1;t=5"#, r#""m";r=0"#, "((", r#""m";r=0;t=-4"#] {
            assert_eq!(
                duration(&c, &headers(&[("ratelimit", value)]), now),
                c.default.0,
                "{value}"
            );
        }
    }
}
