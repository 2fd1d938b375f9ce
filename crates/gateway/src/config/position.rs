//! YAML paths, and finding the line and column of the node a path names.

use std::fmt;

use serde::de::{self, DeserializeSeed, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};

/// A path into the YAML document.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct YamlPath(pub(super) Vec<Segment>);

#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Segment {
    Key(std::borrow::Cow<'static, str>),
    Index(usize),
}

impl YamlPath {
    /// The document itself.
    pub fn root() -> YamlPath {
        YamlPath(Vec::new())
    }
    /// Descends into a mapping key.
    pub fn key(mut self, key: &'static str) -> YamlPath {
        self.0.push(Segment::Key(key.into()));
        self
    }
    /// Descends into a sequence element.
    pub fn index(mut self, i: usize) -> YamlPath {
        self.0.push(Segment::Index(i));
        self
    }
}

impl fmt::Display for YamlPath {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.0.is_empty() {
            return f.write_str(".");
        }
        for (i, s) in self.0.iter().enumerate() {
            match s {
                Segment::Key(k) if i == 0 => write!(f, "{k}")?,
                Segment::Key(k) => write!(f, ".{k}")?,
                Segment::Index(n) => write!(f, "[{n}]")?,
            }
        }
        Ok(())
    }
}

/// Finds the line and column of the node at `path`.
///
/// serde_yaml keeps no positions after parsing, but it stamps an error with the position of the
/// node being read. So we walk the document again, down to the node, and raise an error from
/// inside it. This runs only when a config is already known to be wrong.
pub fn locate(text: &str, path: &YamlPath) -> Option<(usize, usize)> {
    const MARK: &str = "sluice-locate";
    let err = Locator(&path.0)
        .deserialize(serde_yaml::Deserializer::from_str(text))
        .err()?;
    if !err.to_string().contains(MARK) {
        return None;
    }
    err.location().map(|l| (l.line(), l.column()))
}

struct Locator<'a>(&'a [Segment]);

impl<'de> DeserializeSeed<'de> for Locator<'_> {
    type Value = ();
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        if self.0.is_empty() {
            d.deserialize_any(Here)
        } else {
            d.deserialize_any(self)
        }
    }
}

impl<'de> Visitor<'de> for Locator<'_> {
    type Value = ();
    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a node on the path")
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
        let Some(Segment::Key(wanted)) = self.0.first() else {
            return Ok(());
        };
        while let Some(key) = map.next_key::<String>()? {
            if key == **wanted {
                return map.next_value_seed(Locator(&self.0[1..]));
            }
            map.next_value::<IgnoredAny>()?;
        }
        Ok(())
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        let Some(&Segment::Index(wanted)) = self.0.first() else {
            return Ok(());
        };
        for _ in 0..wanted {
            if seq.next_element::<IgnoredAny>()?.is_none() {
                return Ok(());
            }
        }
        seq.next_element_seed(Locator(&self.0[1..])).map(drop)
    }
    fn visit_str<E: de::Error>(self, _: &str) -> Result<(), E> {
        Ok(())
    }
    fn visit_bool<E: de::Error>(self, _: bool) -> Result<(), E> {
        Ok(())
    }
    fn visit_i64<E: de::Error>(self, _: i64) -> Result<(), E> {
        Ok(())
    }
    fn visit_u64<E: de::Error>(self, _: u64) -> Result<(), E> {
        Ok(())
    }
    fn visit_f64<E: de::Error>(self, _: f64) -> Result<(), E> {
        Ok(())
    }
    fn visit_unit<E: de::Error>(self) -> Result<(), E> {
        Ok(())
    }
}

/// Raises the marker error from inside whatever node it is given.
struct Here;

impl<'de> Visitor<'de> for Here {
    type Value = ();
    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("any node")
    }
    fn visit_map<A: MapAccess<'de>>(self, _: A) -> Result<(), A::Error> {
        Err(de::Error::custom("sluice-locate"))
    }
    fn visit_seq<A: SeqAccess<'de>>(self, _: A) -> Result<(), A::Error> {
        Err(de::Error::custom("sluice-locate"))
    }
    fn visit_str<E: de::Error>(self, _: &str) -> Result<(), E> {
        Err(E::custom("sluice-locate"))
    }
    fn visit_bool<E: de::Error>(self, _: bool) -> Result<(), E> {
        Err(E::custom("sluice-locate"))
    }
    fn visit_i64<E: de::Error>(self, _: i64) -> Result<(), E> {
        Err(E::custom("sluice-locate"))
    }
    fn visit_u64<E: de::Error>(self, _: u64) -> Result<(), E> {
        Err(E::custom("sluice-locate"))
    }
    fn visit_f64<E: de::Error>(self, _: f64) -> Result<(), E> {
        Err(E::custom("sluice-locate"))
    }
    fn visit_unit<E: de::Error>(self) -> Result<(), E> {
        Err(E::custom("sluice-locate"))
    }
}
