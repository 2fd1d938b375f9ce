//! What an amount is made of, as the config writes it: `{json: "a.b", default: N, times: F}`,
//! `{value: N}`, `{request_bytes: true, times: F}`, `{header: NAME, times: F}`, or
//! `{sum: [...]}` of those.
//!
//! These types deserialize straight from the config (serde), refusing what cannot be computed,
//! so that the config crate uses them as they are and a route's amounts are checked once, at
//! load.

use std::fmt;
use std::sync::Arc;

use serde::de::Error as _;
use serde::Deserialize;

use crate::amount::Decimal;

/// An amount: a sum of [`Part`]s (one part when the config names no `sum`). Cheap to clone.
#[derive(Debug, Clone, PartialEq)]
pub struct Amount {
    parts: Arc<[Part]>,
}

/// One term of an [`Amount`].
#[derive(Debug, Clone, PartialEq)]
pub enum Part {
    /// A number in a JSON body, times a factor. When the body does not hold it (or, for a
    /// reservation, cannot be read), `default` stands in for the field's value, and the factor
    /// applies to it too; a part without a default then reserves 0 or leaves a settlement
    /// unread ([`crate::Unsettled::NoUsage`]).
    Json {
        path: JsonPath,
        default: Option<Decimal>,
        times: Decimal,
    },
    /// A fixed amount.
    Value(Decimal),
    /// The request body's length in bytes, times a factor: an estimate of a prompt.
    RequestBytes { times: Decimal },
    /// A number in a header (of the request for a reservation, of the response for a
    /// settlement), times a factor.
    Header { name: HeaderName, times: Decimal },
}

impl Amount {
    /// The sum of `parts`; `None` when there is none.
    pub fn sum(parts: Vec<Part>) -> Option<Amount> {
        (!parts.is_empty()).then(|| Amount {
            parts: parts.into(),
        })
    }

    /// A single part.
    pub fn part(part: Part) -> Amount {
        Amount {
            parts: Arc::new([part]),
        }
    }

    /// The terms, at least one.
    pub fn parts(&self) -> &[Part] {
        &self.parts
    }

    /// Whether computing this amount reads a JSON body: only then does a route buffer a
    /// request's body before admission, or scan an answer's.
    pub fn reads_body(&self) -> bool {
        self.parts.iter().any(|p| matches!(p, Part::Json { .. }))
    }

    /// The `json` parts that have no `default`: in a reservation they count 0 when the body
    /// does not hold them, which `check` may want to refuse.
    pub fn json_paths_without_default(&self) -> impl Iterator<Item = &JsonPath> {
        self.parts.iter().filter_map(|p| match p {
            Part::Json {
                path,
                default: None,
                ..
            } => Some(path),
            _ => None,
        })
    }
}

/// A dotted path of object keys: `usage.total_tokens`. Each key is non-empty and holds no
/// `.`, `[` or `]`; arrays are not indexed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JsonPath {
    text: Box<str>,
}

impl JsonPath {
    /// `None` unless `text` is a dotted path: keys separated by single dots, none empty, no
    /// brackets, no whitespace at either end of a key.
    pub fn parse(text: &str) -> Option<JsonPath> {
        let valid = !text.is_empty()
            && text.split('.').all(|key| {
                !key.is_empty()
                    && key.trim() == key
                    && !key.contains(['[', ']'])
                    && !key.chars().any(char::is_control)
            });
        valid.then(|| JsonPath { text: text.into() })
    }

    /// The keys, outermost first.
    pub fn keys(&self) -> std::str::Split<'_, char> {
        self.text.split('.')
    }

    /// The innermost key: an event or body that does not contain it cannot hold the path.
    pub fn last_key(&self) -> &str {
        self.text.rsplit('.').next().unwrap_or(&self.text)
    }

    /// As written.
    pub fn as_str(&self) -> &str {
        &self.text
    }
}

impl fmt::Display for JsonPath {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.text)
    }
}

/// A header name, lowercase, as HTTP/2 and the gateway's header maps compare it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HeaderName(http::HeaderName);

impl HeaderName {
    /// `None` unless `text` is a valid header name.
    pub fn parse(text: &str) -> Option<HeaderName> {
        http::HeaderName::from_bytes(text.as_bytes())
            .ok()
            .map(HeaderName)
    }

    /// Lowercase.
    pub fn as_str(&self) -> &str {
        self.0.as_str()
    }
}

impl fmt::Display for HeaderName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Every field any shape may have; which combinations are valid is checked after.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawAmount {
    json: Option<String>,
    default: Option<Decimal>,
    times: Option<Decimal>,
    value: Option<Decimal>,
    request_bytes: Option<bool>,
    header: Option<String>,
    sum: Option<Vec<RawAmount>>,
}

const SHAPES: &str = "one of json, value, request_bytes, header or sum";

impl RawAmount {
    fn into_part<E: serde::de::Error>(self) -> Result<Part, E> {
        let times = self.times.unwrap_or(Decimal::ONE);
        let kinds = [
            self.json.is_some(),
            self.value.is_some(),
            self.request_bytes.is_some(),
            self.header.is_some(),
            self.sum.is_some(),
        ];
        match kinds.iter().filter(|k| **k).count() {
            0 => return Err(E::custom(format!("an amount needs {SHAPES}"))),
            1 => {}
            _ => return Err(E::custom(format!("an amount has exactly {SHAPES}"))),
        }
        if self.default.is_some() && self.json.is_none() {
            return Err(E::custom("`default` belongs to a `json` amount"));
        }
        if self.times.is_some() && self.value.is_some() {
            return Err(E::custom("a `value` takes no `times`: write the product"));
        }
        if self.sum.is_some() {
            return Err(E::custom(
                "a `sum` holds json, value, request_bytes or header amounts, not another sum",
            ));
        }
        if let Some(text) = self.json {
            let path = JsonPath::parse(&text).ok_or_else(|| {
                E::custom(format!(
                    "json path {text:?} is not a dotted path of object keys (like usage.total_tokens)"
                ))
            })?;
            return Ok(Part::Json {
                path,
                default: self.default,
                times,
            });
        }
        if let Some(value) = self.value {
            return Ok(Part::Value(value));
        }
        if let Some(flag) = self.request_bytes {
            if !flag {
                return Err(E::custom("request_bytes is `true` or left out"));
            }
            return Ok(Part::RequestBytes { times });
        }
        let text = self.header.unwrap_or_default();
        let name = HeaderName::parse(&text)
            .ok_or_else(|| E::custom(format!("{text:?} is not a header name")))?;
        Ok(Part::Header { name, times })
    }
}

impl<'de> Deserialize<'de> for Amount {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Amount, D::Error> {
        let mut raw = RawAmount::deserialize(d)?;
        let Some(parts) = raw.sum.take() else {
            return raw.into_part().map(Amount::part);
        };
        let alone = RawAmount { sum: None, ..raw };
        if alone.json.is_some()
            || alone.value.is_some()
            || alone.request_bytes.is_some()
            || alone.header.is_some()
            || alone.default.is_some()
            || alone.times.is_some()
        {
            return Err(D::Error::custom(
                "a `sum` stands alone: put times and defaults on its parts",
            ));
        }
        let parts = parts
            .into_iter()
            .map(RawAmount::into_part)
            .collect::<Result<Vec<_>, _>>()?;
        Amount::sum(parts).ok_or_else(|| D::Error::custom("a `sum` needs at least one part"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Millionths;

    fn amount(json: &str) -> Result<Amount, String> {
        serde_json::from_str(json).map_err(|e| e.to_string())
    }

    #[test]
    fn every_shape_deserializes() {
        let a = amount(r#"{"json": "max_tokens", "default": 4096}"#).unwrap();
        assert_eq!(
            a.parts(),
            [Part::Json {
                path: JsonPath::parse("max_tokens").unwrap(),
                default: Some(Decimal::from_u64(4096)),
                times: Decimal::ONE
            }]
        );
        assert!(a.reads_body());
        let a = amount(r#"{"value": 0.10}"#).unwrap();
        assert_eq!(a.parts(), [Part::Value(Decimal::from_f64(0.1).unwrap())]);
        assert!(!a.reads_body());
        let a = amount(r#"{"request_bytes": true, "times": 0.25}"#).unwrap();
        assert_eq!(
            a.parts(),
            [Part::RequestBytes {
                times: Decimal::from_f64(0.25).unwrap()
            }]
        );
        let a = amount(r#"{"header": "X-Usage-Tokens", "times": 2}"#).unwrap();
        match &a.parts()[0] {
            Part::Header { name, times } => {
                assert_eq!(name.as_str(), "x-usage-tokens");
                assert_eq!(times.to_millionths(), Some(Millionths(2_000_000)));
            }
            other => panic!("{other:?}"),
        }
        let a = amount(
            r#"{"sum": [{"json": "usage.prompt_tokens", "times": 0.0000025},
                        {"json": "usage.completion_tokens", "times": 0.00001}]}"#,
        )
        .unwrap();
        assert_eq!(a.parts().len(), 2);
        assert_eq!(a.json_paths_without_default().count(), 2);
    }

    #[test]
    fn what_cannot_be_computed_is_refused() {
        for (bad, says) in [
            (r#"{}"#, "needs one of"),
            (r#"{"json": "a", "value": 1}"#, "exactly one of"),
            (r#"{"json": "a[0]"}"#, "not a dotted path"),
            (r#"{"json": "a..b"}"#, "not a dotted path"),
            (r#"{"json": ".a"}"#, "not a dotted path"),
            (r#"{"json": ""}"#, "not a dotted path"),
            (r#"{"json": "a", "times": -1}"#, "negative"),
            (r#"{"value": -0.5}"#, "non-negative"),
            (r#"{"value": 1, "times": 2}"#, "no `times`"),
            (r#"{"value": 1, "default": 2}"#, "belongs to a `json`"),
            (r#"{"request_bytes": false}"#, "`true` or left out"),
            (r#"{"header": "bad header"}"#, "not a header name"),
            (r#"{"sum": []}"#, "at least one part"),
            (r#"{"sum": [{"sum": [{"value": 1}]}]}"#, "not another sum"),
            (r#"{"sum": [{"value": 1}], "times": 2}"#, "stands alone"),
            (r#"{"jsn": "a"}"#, "unknown field"),
        ] {
            let err = amount(bad).unwrap_err();
            assert!(err.contains(says), "{bad}: {err}");
        }
    }

    #[test]
    fn paths_split_into_keys() {
        let p = JsonPath::parse("usage.total_tokens").unwrap();
        assert_eq!(p.keys().collect::<Vec<_>>(), ["usage", "total_tokens"]);
        assert_eq!(p.last_key(), "total_tokens");
        assert_eq!(
            JsonPath::parse("max_tokens").unwrap().last_key(),
            "max_tokens"
        );
        assert!(JsonPath::parse("a. b").is_none());
        assert!(JsonPath::parse("a.").is_none());
    }
}
