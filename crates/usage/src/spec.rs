//! What an amount is made of, as the config writes it: `{json: "a.b", default: N, times: F}`,
//! `{value: N}`, `{request_bytes: true, times: F}`, `{header: NAME, times: F}`, or
//! `{sum: [...]}` of those.
//!
//! The config checks these shapes and keeps their numbers as written (`sluice_config::Amount`);
//! [`Amount::from`] turns one into the form amounts are computed from, once per config load.

use std::fmt;
use std::sync::Arc;

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

/// A number the config checked (finite, 0 or more), taken as written.
fn written(x: f64) -> Decimal {
    // The config refuses negative and non-finite numbers, the only ones without a decimal.
    Decimal::from_f64(x).unwrap_or(Decimal::ZERO)
}

impl Part {
    /// A config amount that is not a sum.
    fn from_config(leaf: &sluice_config::Amount) -> Option<Part> {
        Some(match leaf {
            sluice_config::Amount::Json {
                path,
                default,
                times,
            } => Part::Json {
                // The config's paths are dotted object keys already (and stricter than
                // `JsonPath::parse`).
                path: JsonPath {
                    text: path.text.as_ref().into(),
                },
                default: default.map(written),
                times: written(*times),
            },
            sluice_config::Amount::Value(value) => Part::Value(written(*value)),
            sluice_config::Amount::RequestBytes { times } => Part::RequestBytes {
                times: written(*times),
            },
            sluice_config::Amount::Header { name, times } => Part::Header {
                name: HeaderName(name.clone()),
                times: written(*times),
            },
            sluice_config::Amount::Sum(_) => return None,
        })
    }
}

/// An amount as the config checked it: a sum flattened into its parts, each number taken as
/// written (its shortest decimal form) so that products round exactly once.
impl From<&sluice_config::Amount> for Amount {
    fn from(config: &sluice_config::Amount) -> Amount {
        let parts = config
            .leaves()
            .into_iter()
            .filter_map(Part::from_config)
            .collect();
        // The config refuses an empty sum; nothing would be a zero amount.
        Amount::sum(parts).unwrap_or_else(|| Amount::part(Part::Value(Decimal::ZERO)))
    }
}

/// An amount from the config's shapes written in JSON, for tests.
#[cfg(test)]
pub(crate) fn from_config_json(json: &str) -> Amount {
    let config: sluice_config::Amount = serde_json::from_str(json).expect("a valid config amount");
    Amount::from(&config)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Millionths;

    #[test]
    fn every_config_shape_converts() {
        let a = from_config_json(r#"{"json": "max_tokens", "default": 4096}"#);
        assert_eq!(
            a.parts(),
            [Part::Json {
                path: JsonPath::parse("max_tokens").unwrap(),
                default: Some(Decimal::from_u64(4096)),
                times: Decimal::ONE
            }]
        );
        assert!(a.reads_body());
        let a = from_config_json(r#"{"value": 0.10}"#);
        assert_eq!(a.parts(), [Part::Value(Decimal::from_f64(0.1).unwrap())]);
        assert!(!a.reads_body());
        let a = from_config_json(r#"{"request_bytes": true, "times": 0.25}"#);
        assert_eq!(
            a.parts(),
            [Part::RequestBytes {
                times: Decimal::from_f64(0.25).unwrap()
            }]
        );
        let a = from_config_json(r#"{"header": "X-Usage-Tokens", "times": 2}"#);
        match &a.parts()[0] {
            Part::Header { name, times } => {
                assert_eq!(name.as_str(), "x-usage-tokens");
                assert_eq!(times.to_millionths(), Some(Millionths(2_000_000)));
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn sums_flatten_and_prices_stay_as_written() {
        let a = from_config_json(
            r#"{"sum": [{"json": "usage.prompt_tokens", "times": 0.0000025},
                        {"sum": [{"json": "usage.completion_tokens", "times": 0.00001}, {"value": 0.5}]}]}"#,
        );
        assert_eq!(a.parts().len(), 3);
        assert_eq!(a.json_paths_without_default().count(), 2);
        let Part::Json { path, times, .. } = &a.parts()[0] else {
            panic!("{a:?}")
        };
        assert_eq!(path.as_str(), "usage.prompt_tokens");
        assert_eq!(
            Decimal::from_u64(1000).times(*times),
            Some(Millionths(2500))
        );
        assert_eq!(a.parts()[2], Part::Value(Decimal::from_f64(0.5).unwrap()));
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
        for bad in ["a. b", "a.", ".a", "a..b", "a[0]", ""] {
            assert!(JsonPath::parse(bad).is_none(), "{bad}");
        }
    }
}
