//! The serde types of usage-metered quotas: a window's `unit`, calendar windows and their `tz`,
//! and a quota's `usage` units with the amounts they reserve at admission and settle from the
//! answer. Each type checks itself while parsed, so a bad value is placed at its own line.
//!
//! Amounts are kept here as written (`f64`). Turning them into fixed point, and reading them
//! from bodies and headers, belongs to the code that meters (`sluice-usage`), so that one place
//! rounds.

use std::num::NonZeroU32;
use std::sync::Arc;

use serde::de::{self, Deserializer};
use serde::Deserialize;

use super::Dur;

/// The largest amount a `value` or `default` may give, in units: stores keep amounts in
/// millionths and Redis scripts count in doubles, exact up to 2^53 millionths.
pub const MAX_AMOUNT: f64 = 9_007_199_254.0;

/// The largest `usage.max_request_body`: the bytes read before admission are kept in the
/// buffer a replay (`cooldown.retry`) is sent from, which holds 64 KiB, so that the member gets
/// them whichever attempt it is.
pub const MAX_REQUEST_BODY: u32 = 64 * 1024;

/// The largest `usage.max_response_body`: it is held per request in flight, so a larger one
/// would let a few requests take the gateway's memory.
pub const MAX_RESPONSE_BODY: u32 = 16 * 1024 * 1024;

/// A window's `window:` — a sliding length, or a calendar period.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WindowSpan {
    /// Any interval of this length (`1m`, `1d`).
    Sliding(Dur),
    /// A fixed period that resets at its boundary in the window's `tz`.
    Calendar(CalendarPeriod),
}

impl WindowSpan {
    /// The sliding length, or `None` for a calendar window.
    pub fn sliding(&self) -> Option<std::time::Duration> {
        match self {
            WindowSpan::Sliding(d) => Some(d.0),
            WindowSpan::Calendar(_) => None,
        }
    }
}

impl<'de> Deserialize<'de> for WindowSpan {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        let period = match s.trim() {
            "calendar_day" => Some(CalendarPeriod::Day),
            "calendar_week" => Some(CalendarPeriod::Week),
            "calendar_month" => Some(CalendarPeriod::Month),
            _ => None,
        };
        if let Some(p) = period {
            return Ok(WindowSpan::Calendar(p));
        }
        if s.trim().starts_with("calendar") {
            return Err(de::Error::custom(format!(
                "unknown calendar window {s:?}: calendar_day, calendar_week or calendar_month"
            )));
        }
        Dur::deserialize(de::value::StrDeserializer::<D::Error>::new(&s)).map(WindowSpan::Sliding)
    }
}

/// The period of a calendar window.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CalendarPeriod {
    /// From midnight to midnight.
    Day,
    /// From Monday midnight to the next (ISO weeks).
    Week,
    /// From the first of the month at midnight to the next first.
    Month,
}

/// A window's `tz`: an IANA time zone name such as `Europe/Paris`, from the tz database built
/// into sluice (so that every instance and machine cuts periods at the same instants).
#[derive(Debug, Clone)]
pub struct TimeZoneName {
    /// The name as written.
    pub name: Arc<str>,
    /// The zone.
    pub zone: jiff::tz::TimeZone,
}

impl TimeZoneName {
    /// UTC, the zone of a calendar window that names none.
    pub fn utc() -> TimeZoneName {
        TimeZoneName {
            name: "UTC".into(),
            zone: jiff::tz::TimeZone::UTC,
        }
    }
}

impl PartialEq for TimeZoneName {
    fn eq(&self, other: &TimeZoneName) -> bool {
        self.name == other.name
    }
}

impl<'de> Deserialize<'de> for TimeZoneName {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let name = String::deserialize(d)?;
        let zone = jiff::tz::db().get(&name).map_err(|_| {
            de::Error::custom(format!(
                "unknown time zone {name:?}: give an IANA name such as UTC, Europe/Paris or America/New_York"
            ))
        })?;
        Ok(TimeZoneName {
            name: name.into(),
            zone,
        })
    }
}

/// A window's `unit`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash)]
pub enum WindowUnit {
    /// Requests, charged by `cost` (the default).
    #[default]
    Requests,
    /// A unit defined under the route's `quota.usage`.
    Named(UnitName),
}

impl<'de> Deserialize<'de> for WindowUnit {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        if s == "requests" {
            return Ok(WindowUnit::Requests);
        }
        UnitName::parse(&s)
            .map(WindowUnit::Named)
            .map_err(de::Error::custom)
    }
}

/// The name of a usage unit: `[A-Za-z0-9_-]+`, not `requests` (the built-in unit) nor one of
/// the `usage` settings.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct UnitName(pub Arc<str>);

impl UnitName {
    fn parse(s: &str) -> Result<UnitName, String> {
        let word = !s.is_empty()
            && s.len() <= 64
            && s.bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-');
        if !word {
            return Err(format!(
                "invalid unit {s:?}: use 1 to 64 of letters, digits, '_' and '-'"
            ));
        }
        if s == "requests" || USAGE_SETTINGS.contains(&s) {
            return Err(format!(
                "{s:?} cannot name a usage unit: it is a built-in name"
            ));
        }
        Ok(UnitName(s.into()))
    }
}

/// The keys of `usage` that are settings rather than unit names.
const USAGE_SETTINGS: &[&str] = &["max_request_body", "max_response_body", "zero_on"];

/// `quota.usage`: the units a route's windows (and its members' and clients' windows) may count
/// in, and how their amounts are read.
#[derive(Debug, Clone, PartialEq)]
pub struct UsageConfig {
    /// The units, in the order written.
    pub units: Vec<UnitConfig>,
    /// Bytes of the request body read, before admission, for a `json` reservation; a longer
    /// body takes the default.
    pub max_request_body: NonZeroU32,
    /// Bytes of a JSON response body kept to find the settled amount; past it the request is
    /// unsettled and its reservation stands.
    pub max_response_body: NonZeroU32,
    /// Member answers with these statuses settle to 0: the member did no work.
    pub zero_on: Vec<u16>,
}

impl UsageConfig {
    /// The unit named `name`.
    pub fn unit(&self, name: &UnitName) -> Option<&UnitConfig> {
        self.units.iter().find(|u| u.name == *name)
    }

    /// Whether some unit's reservation reads the request body, so that the body's first
    /// `max_request_body` bytes must be read before admission.
    pub fn reads_request_body(&self) -> bool {
        self.units.iter().any(|u| u.reserve.reads_body())
    }
}

impl<'de> Deserialize<'de> for UsageConfig {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Visit;
        impl<'de> de::Visitor<'de> for Visit {
            type Value = UsageConfig;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a mapping of unit names to {reserve, settle}, with optional max_request_body, max_response_body and zero_on")
            }
            fn visit_map<M: de::MapAccess<'de>>(self, mut m: M) -> Result<UsageConfig, M::Error> {
                let mut out = UsageConfig {
                    units: Vec::new(),
                    max_request_body: NonZeroU32::new(MAX_REQUEST_BODY).unwrap_or(NonZeroU32::MIN),
                    max_response_body: NonZeroU32::new(1024 * 1024).unwrap_or(NonZeroU32::MIN),
                    zero_on: vec![429],
                };
                let mut seen: Vec<String> = Vec::new();
                while let Some(key) = m.next_key::<String>()? {
                    if seen.contains(&key) {
                        return Err(de::Error::custom(format!("{key:?} is given twice")));
                    }
                    match key.as_str() {
                        "max_request_body" => out.max_request_body = m.next_value()?,
                        "max_response_body" => out.max_response_body = m.next_value()?,
                        "zero_on" => out.zero_on = m.next_value()?,
                        _ => {
                            let name = UnitName::parse(&key).map_err(de::Error::custom)?;
                            let unit: RawUnit = m.next_value()?;
                            out.units.push(UnitConfig {
                                name,
                                reserve: unit.reserve,
                                settle: unit.settle,
                            });
                        }
                    }
                    seen.push(key);
                }
                Ok(out)
            }
        }
        d.deserialize_map(Visit)
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawUnit {
    reserve: Amount,
    settle: Amount,
}

/// One usage unit.
#[derive(Debug, Clone, PartialEq)]
pub struct UnitConfig {
    /// Its name, which windows give as `unit`.
    pub name: UnitName,
    /// What a request is charged at admission, from the request.
    pub reserve: Amount,
    /// What the request's log entry becomes when the answer ends, from the answer.
    pub settle: Amount,
}

/// An amount in a unit: read from a body or a header, fixed, or a sum.
#[derive(Debug, Clone, PartialEq)]
pub enum Amount {
    /// A number at a dotted path of a JSON body (the request's for `reserve`, the response's or
    /// its last Server-Sent Event holding the path for `settle`), times `times`.
    Json {
        /// The path.
        path: JsonPath,
        /// Taken in place of the field's value when it cannot be read (then times `times`,
        /// like a value read). A `reserve` must have one; without it, a `settle` that cannot
        /// be read leaves the reservation standing.
        default: Option<f64>,
        /// The factor.
        times: f64,
    },
    /// A fixed amount.
    Value(f64),
    /// The request body's length in bytes (its `Content-Length`, or the bytes read), times
    /// `times`: an estimate of a prompt. `reserve` only.
    RequestBytes {
        /// The factor.
        times: f64,
    },
    /// A number in a response header, times `times`. `settle` only.
    Header {
        /// The header, lowercased.
        name: http::HeaderName,
        /// The factor.
        times: f64,
    },
    /// The sum of several amounts.
    Sum(Vec<Amount>),
}

impl Amount {
    /// Whether computing the amount reads a body (a `json` part).
    pub fn reads_body(&self) -> bool {
        match self {
            Amount::Json { .. } => true,
            Amount::Sum(parts) => parts.iter().any(Amount::reads_body),
            _ => false,
        }
    }

    /// Every part that is not a sum, depth first.
    pub fn leaves(&self) -> Vec<&Amount> {
        let mut out = Vec::new();
        let mut stack = vec![self];
        while let Some(a) = stack.pop() {
            match a {
                Amount::Sum(parts) => stack.extend(parts.iter().rev()),
                leaf => out.push(leaf),
            }
        }
        out
    }
}

impl<'de> Deserialize<'de> for Amount {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let raw = RawAmount::deserialize(d)?;
        let given = [
            raw.json.is_some(),
            raw.value.is_some(),
            raw.request_bytes.is_some(),
            raw.header.is_some(),
            raw.sum.is_some(),
        ];
        if given.iter().filter(|g| **g).count() != 1 {
            return Err(de::Error::custom(
                "an amount is exactly one of {json: PATH}, {value: N}, {request_bytes: true}, {header: NAME} or {sum: [...]}",
            ));
        }
        if raw.default.is_some() && raw.json.is_none() {
            return Err(de::Error::custom(
                "default applies to {json: PATH} only: the value taken when the field cannot be read",
            ));
        }
        let times = raw.times.map_or(1.0, |t| t.0);
        if raw.times.is_some() && (raw.value.is_some() || raw.sum.is_some()) {
            return Err(de::Error::custom(
                "times applies to json, request_bytes and header; write the product as the value, or give times to each part of the sum",
            ));
        }
        if let Some(path) = raw.json {
            return Ok(Amount::Json {
                path,
                default: raw.default.map(|d| d.0),
                times,
            });
        }
        if let Some(v) = raw.value {
            return Ok(Amount::Value(v.0));
        }
        if let Some(yes) = raw.request_bytes {
            if !yes {
                return Err(de::Error::custom(
                    "request_bytes: false is not an amount; write request_bytes: true, or leave the part out",
                ));
            }
            return Ok(Amount::RequestBytes { times });
        }
        if let Some(name) = raw.header {
            let name = http::HeaderName::from_bytes(name.as_bytes())
                .map_err(|_| de::Error::custom(format!("invalid header name {name:?}")))?;
            return Ok(Amount::Header { name, times });
        }
        let parts = raw.sum.unwrap_or_default();
        if parts.is_empty() {
            return Err(de::Error::custom("sum needs at least one part"));
        }
        Ok(Amount::Sum(parts))
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawAmount {
    #[serde(default)]
    json: Option<JsonPath>,
    #[serde(default)]
    default: Option<Quantity>,
    #[serde(default)]
    value: Option<Quantity>,
    #[serde(default)]
    request_bytes: Option<bool>,
    #[serde(default)]
    header: Option<String>,
    #[serde(default)]
    sum: Option<Vec<Amount>>,
    #[serde(default)]
    times: Option<Factor>,
}

/// A dotted path into a JSON document, `usage.total_tokens`: object keys only, none empty.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JsonPath {
    /// The path as written.
    pub text: Arc<str>,
    /// Its keys, outermost first.
    pub keys: Vec<Arc<str>>,
}

impl<'de> Deserialize<'de> for JsonPath {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        let keys: Vec<&str> = s.split('.').collect();
        let bad = keys.iter().any(|k| {
            k.is_empty()
                || k.chars().any(|c| {
                    matches!(c, '[' | ']' | '*' | '$') || c.is_whitespace() || c.is_control()
                })
        });
        if bad {
            return Err(de::Error::custom(format!(
                "invalid json path {s:?}: write object keys joined by dots, such as usage.total_tokens (no brackets, wildcards, spaces or empty keys)"
            )));
        }
        Ok(JsonPath {
            keys: keys.iter().map(|k| Arc::from(*k)).collect(),
            text: s.into(),
        })
    }
}

/// A `value` or `default`: a finite number of units, 0 to [`MAX_AMOUNT`].
#[derive(Debug, Clone, Copy, PartialEq)]
struct Quantity(f64);

impl<'de> Deserialize<'de> for Quantity {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let v = f64::deserialize(d)?;
        if !v.is_finite() || v < 0.0 {
            return Err(de::Error::custom(format!(
                "{v} is not an amount: give a finite number, 0 or more"
            )));
        }
        if v > MAX_AMOUNT {
            return Err(de::Error::custom(format!(
                "{v} is too large: an amount is at most {MAX_AMOUNT} units, as stores keep millionths exact to 2^53"
            )));
        }
        Ok(Quantity(v))
    }
}

/// A `times`: a finite factor, 0 or more.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Factor(f64);

impl<'de> Deserialize<'de> for Factor {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let v = f64::deserialize(d)?;
        if !v.is_finite() || v < 0.0 {
            return Err(de::Error::custom(format!(
                "times {v} is not a factor: give a finite number, 0 or more"
            )));
        }
        Ok(Factor(v))
    }
}
