//! `upstream.sticky`: requests of one session go to one member (SPEC §11).

use std::num::NonZeroU64;
use std::time::Duration;

use serde::de::{self, Deserializer, Visitor};
use serde::Deserialize;

use super::Dur;

/// `upstream.sticky`: the session a request belongs to, and how long its binding to a member
/// lives.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct StickyConfig {
    /// What names the session.
    pub key: StickyKey,
    /// How long a binding lives after the session's last request.
    #[serde(default = "default_sticky_ttl")]
    pub ttl: Dur,
    /// The member's answers (and failures) that move the session elsewhere.
    #[serde(default = "default_rebind_on")]
    pub rebind_on: Vec<RebindOn>,
    /// The most bindings the route keeps; a new session past it goes unbound.
    #[serde(default = "default_max_bindings")]
    pub max_bindings: NonZeroU64,
}

fn default_sticky_ttl() -> Dur {
    Dur(Duration::from_secs(600))
}
fn default_rebind_on() -> Vec<RebindOn> {
    vec![RebindOn::Status(429), RebindOn::ConnectError]
}
fn default_max_bindings() -> NonZeroU64 {
    NonZeroU64::new(100_000).unwrap_or(NonZeroU64::MIN)
}

/// What names a request's session: `header:NAME`, `cookie:NAME` or `client`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StickyKey {
    /// The value of this request header (its name lowercase).
    Header(String),
    /// The value of this cookie.
    Cookie(String),
    /// The client identified (`clients`), else the client's address.
    Client,
}

/// An HTTP token (RFC 9110), as header and cookie names are.
fn token(s: &str) -> bool {
    !s.is_empty()
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b))
}

impl StickyKey {
    pub fn parse(s: &str) -> Result<StickyKey, String> {
        let wrong = || {
            format!(
                "invalid sticky key {s:?}: expected \"header:NAME\", \"cookie:NAME\" or \"client\""
            )
        };
        if s == "client" {
            return Ok(StickyKey::Client);
        }
        let (kind, name) = s.split_once(':').ok_or_else(wrong)?;
        if !token(name) {
            return Err(wrong());
        }
        match kind {
            "header" => Ok(StickyKey::Header(name.to_ascii_lowercase())),
            "cookie" => Ok(StickyKey::Cookie(name.to_string())),
            _ => Err(wrong()),
        }
    }
}

impl<'de> Deserialize<'de> for StickyKey {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        StickyKey::parse(&s).map_err(de::Error::custom)
    }
}

/// One entry of `rebind_on`: a member's status, or `connect_error`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RebindOn {
    /// The member answered this status (100-599).
    Status(u16),
    /// The member could not be connected to.
    ConnectError,
}

impl<'de> Deserialize<'de> for RebindOn {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl Visitor<'_> for V {
            type Value = RebindOn;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("an HTTP status (100-599) or connect_error")
            }
            fn visit_u64<E: de::Error>(self, n: u64) -> Result<RebindOn, E> {
                match u16::try_from(n) {
                    Ok(n) if (100..=599).contains(&n) => Ok(RebindOn::Status(n)),
                    _ => Err(E::custom(format!(
                        "invalid rebind_on status {n}: expected 100-599"
                    ))),
                }
            }
            fn visit_i64<E: de::Error>(self, n: i64) -> Result<RebindOn, E> {
                match u64::try_from(n) {
                    Ok(n) => self.visit_u64(n),
                    Err(_) => Err(E::custom(format!(
                        "invalid rebind_on status {n}: expected 100-599"
                    ))),
                }
            }
            fn visit_str<E: de::Error>(self, s: &str) -> Result<RebindOn, E> {
                match s {
                    "connect_error" => Ok(RebindOn::ConnectError),
                    _ => Err(E::custom(format!(
                        "invalid rebind_on entry {s:?}: expected an HTTP status or connect_error"
                    ))),
                }
            }
        }
        d.deserialize_any(V)
    }
}
