//! Finding one path's number in a JSON text without building the document: a serde visitor
//! that follows the path's keys and skips every other value (`IgnoredAny`), so a lookup costs a
//! pass over the bytes and no allocation.

use std::fmt;

use serde::de::{DeserializeSeed, IgnoredAny, MapAccess, SeqAccess, Visitor};

use crate::amount::Decimal;
use crate::spec::JsonPath;

/// What a JSON text holds at a path.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Found {
    /// A non-negative number.
    Number(Decimal),
    /// No value there, or `null`: some key on the way is missing or not an object.
    Absent,
    /// Something that is not a usable amount: a negative number, a string, a boolean, an
    /// object or an array.
    NotANumber,
}

/// Why a text has no answer at all.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NotJson;

/// The value at `path` in `text`, which must be one whole JSON value (whitespace around it
/// allowed). serde_json's own nesting limit (128) keeps a hostile text from exhausting the stack.
pub fn lookup(text: &[u8], path: &JsonPath) -> Result<Found, NotJson> {
    let mut keys = path.keys();
    let first = keys.next();
    let mut de = serde_json::Deserializer::from_slice(text);
    let found = Node {
        key: first,
        rest: keys,
    }
    .deserialize(&mut de)
    .map_err(|_| NotJson)?;
    de.end().map_err(|_| NotJson)?;
    Ok(found)
}

/// The part of a path still to follow: `key` is the next key, `None` at the leaf.
#[derive(Clone)]
struct Node<'p> {
    key: Option<&'p str>,
    rest: std::str::Split<'p, char>,
}

impl<'de> DeserializeSeed<'de> for Node<'_> {
    type Value = Found;
    fn deserialize<D: serde::Deserializer<'de>>(self, d: D) -> Result<Found, D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for Node<'_> {
    type Value = Found;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("any JSON value")
    }

    fn visit_u64<E>(self, n: u64) -> Result<Found, E> {
        Ok(self.leaf(Found::Number(Decimal::from_u64(n))))
    }

    fn visit_i64<E>(self, n: i64) -> Result<Found, E> {
        Ok(self.leaf(match u64::try_from(n) {
            Ok(n) => Found::Number(Decimal::from_u64(n)),
            Err(_) => Found::NotANumber,
        }))
    }

    fn visit_f64<E>(self, x: f64) -> Result<Found, E> {
        Ok(self.leaf(Decimal::from_f64(x).map_or(Found::NotANumber, Found::Number)))
    }

    fn visit_bool<E>(self, _: bool) -> Result<Found, E> {
        Ok(self.leaf(Found::NotANumber))
    }

    fn visit_str<E>(self, _: &str) -> Result<Found, E> {
        Ok(self.leaf(Found::NotANumber))
    }

    fn visit_unit<E>(self) -> Result<Found, E> {
        Ok(Found::Absent)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Found, A::Error> {
        while seq.next_element::<IgnoredAny>()?.is_some() {}
        Ok(self.leaf(Found::NotANumber))
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Found, A::Error> {
        let Some(key) = self.key else {
            while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
            return Ok(Found::NotANumber);
        };
        let mut found = Found::Absent;
        while let Some(matches) = map.next_key_seed(KeyIs(key))? {
            if matches {
                let mut rest = self.rest.clone();
                let next = rest.next();
                // A key given twice: the last one counts, as in most JSON readers.
                found = map.next_value_seed(Node { key: next, rest })?;
            } else {
                map.next_value::<IgnoredAny>()?;
            }
        }
        Ok(found)
    }
}

impl Node<'_> {
    /// `found` if the path ends here; a scalar in the middle of a path means the path is absent.
    fn leaf(&self, found: Found) -> Found {
        if self.key.is_none() {
            found
        } else {
            Found::Absent
        }
    }
}

/// Whether a map key is the one the path names, compared without copying it.
struct KeyIs<'p>(&'p str);

impl<'de> DeserializeSeed<'de> for KeyIs<'_> {
    type Value = bool;
    fn deserialize<D: serde::Deserializer<'de>>(self, d: D) -> Result<bool, D::Error> {
        d.deserialize_str(self)
    }
}

impl Visitor<'_> for KeyIs<'_> {
    type Value = bool;
    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("an object key")
    }
    fn visit_str<E>(self, key: &str) -> Result<bool, E> {
        Ok(key == self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(text: &str, path: &str) -> Result<Found, NotJson> {
        lookup(text.as_bytes(), &JsonPath::parse(path).unwrap())
    }

    fn n(x: u64) -> Found {
        Found::Number(Decimal::from_u64(x))
    }

    #[test]
    fn follows_keys_and_skips_the_rest() {
        let body = r#"{"id":"x","choices":[{"message":{"usage":1}}],"usage":{"prompt_tokens":9,"total_tokens":21}}"#;
        assert_eq!(at(body, "usage.total_tokens"), Ok(n(21)));
        assert_eq!(at(body, "usage.prompt_tokens"), Ok(n(9)));
        assert_eq!(at(body, "usage.completion_tokens"), Ok(Found::Absent));
        assert_eq!(at(body, "id.x"), Ok(Found::Absent));
        assert_eq!(at(r#"{"a":{"b":null}}"#, "a.b"), Ok(Found::Absent));
        assert_eq!(at(r#"{"a":null}"#, "a.b"), Ok(Found::Absent));
        assert_eq!(at(r#"{"a":1,"a":2}"#, "a"), Ok(n(2)));
        assert_eq!(at(r#"{"a\u005fb":3}"#, "a_b"), Ok(n(3)));
        assert_eq!(
            at(r#" {"a": 2.5} "#, "a"),
            Ok(Found::Number(Decimal::from_f64(2.5).unwrap()))
        );
    }

    #[test]
    fn a_path_to_anything_but_a_non_negative_number_is_not_a_number() {
        for body in [
            r#"{"a":-1}"#,
            r#"{"a":-0.5}"#,
            r#"{"a":"12"}"#,
            r#"{"a":true}"#,
            r#"{"a":{"b":1}}"#,
            r#"{"a":[1]}"#,
        ] {
            assert_eq!(at(body, "a"), Ok(Found::NotANumber), "{body}");
        }
        // Larger than u64: a double, whose size the amount then refuses.
        assert!(matches!(
            at(r#"{"a":123456789012345678901234567890}"#, "a"),
            Ok(Found::Number(_))
        ));
    }

    #[test]
    fn text_that_is_not_one_json_value_is_not_json() {
        for body in [
            "",
            "[DONE]",
            "{\"a\":1",
            "{\"a\":1} x",
            "{\"a\":NaN}",
            "{\"a\":1e999}",
        ] {
            assert_eq!(at(body, "a"), Err(NotJson), "{body}");
        }
        let deep = "[".repeat(100_000);
        assert_eq!(at(&deep, "a"), Err(NotJson));
    }
}
