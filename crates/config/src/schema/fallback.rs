//! `fallback:` — the routes a request goes on to when its own route cannot serve it.

use serde::de::{self, Deserializer, Visitor};
use serde::Deserialize;

use super::RouteName;

/// The most routes a request goes on to after its own. A longer chain would hold a request
/// through as many admissions, each a store call.
pub const MAX_FALLBACK_HOPS: usize = 3;

/// One entry of a route's `fallback` list: the route to go on to, and when.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct FallbackConfig {
    /// The route that takes the request next, with its own quota, members, headers and
    /// clients check.
    pub route: RouteName,
    /// What sends the request there.
    pub on: Vec<FallbackOn>,
}

/// Why a request falls back: the route refused it before any member saw it, or a member
/// answered with a status that says it did no work.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FallbackOn {
    /// The route's quota (or the client's own windows) refused the request.
    QuotaExceeded,
    /// No member of the route was eligible.
    NoMember,
    /// The route, or every member it could use, held its `max_in_flight` requests.
    ConcurrencyExceeded,
    /// A member answered 429.
    TooManyRequests,
    /// A member answered 503 with `Retry-After`: it did no work and says when to come back.
    /// A 503 without it may come from a member that failed midway, so it is never re-sent.
    Unavailable,
}

impl FallbackOn {
    /// The label of `sluice_fallbacks_total{reason}` and of the access log.
    pub fn as_str(self) -> &'static str {
        match self {
            FallbackOn::QuotaExceeded => "quota_exceeded",
            FallbackOn::NoMember => "no_member",
            FallbackOn::ConcurrencyExceeded => "concurrency_exceeded",
            FallbackOn::TooManyRequests => "429",
            FallbackOn::Unavailable => "503",
        }
    }
}

impl<'de> Deserialize<'de> for FallbackOn {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct On;
        const EXPECTED: &str = "quota_exceeded, no_member, concurrency_exceeded, 429 or 503";
        fn status<E: de::Error>(status: u64) -> Result<FallbackOn, E> {
            match status {
                429 => Ok(FallbackOn::TooManyRequests),
                503 => Ok(FallbackOn::Unavailable),
                other => Err(E::custom(format!(
                    "{other} cannot send a request on: only 429 and 503 (with Retry-After) say that the member did no work, so that the request may go elsewhere"
                ))),
            }
        }
        impl Visitor<'_> for On {
            type Value = FallbackOn;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str(EXPECTED)
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<FallbackOn, E> {
                status(v)
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<FallbackOn, E> {
                status(u64::try_from(v).unwrap_or(0))
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<FallbackOn, E> {
                match v {
                    "quota_exceeded" => Ok(FallbackOn::QuotaExceeded),
                    "no_member" => Ok(FallbackOn::NoMember),
                    "concurrency_exceeded" => Ok(FallbackOn::ConcurrencyExceeded),
                    _ => match v.parse::<u64>() {
                        Ok(n) => status(n),
                        Err(_) => Err(E::custom(format!("unknown reason {v:?}: use {EXPECTED}"))),
                    },
                }
            }
        }
        d.deserialize_any(On)
    }
}
