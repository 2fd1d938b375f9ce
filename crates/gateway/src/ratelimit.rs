//! The syntax of the `RateLimit-Policy` and `RateLimit` headers of
//! draft-ietf-httpapi-ratelimit-headers (-12), in one place: the route's policy is written once
//! when the table is built, a request's item once per answer.
//!
//! Both fields are Structured Field Lists of Items, each a String naming a policy, with
//! parameters (`q`, `w` for a policy; `r`, `t` for a service limit; `pk` for the partition key
//! on either). A list may be split over several field lines, which is how sluice adds its own
//! items to a member's: the draft asks intermediaries not to remove the origin's fields, and an
//! API's own limits are what its clients most need to see.

use http::HeaderValue;
use sluice_limiter::{Outcome, Window};

/// `"<name>";q=<limit>;w=<seconds>, …` for every window, each limit in the window's own unit
/// (`units`, as [`in_own_unit`]). Structured-field integers have no fractions, so
/// a window shorter than a second is announced as 1 s.
pub(crate) fn policy(windows: &[Window], units: &[UnitName]) -> HeaderValue {
    let text = windows
        .iter()
        .enumerate()
        .map(|(i, w)| {
            format!(
                "\"{}\";q={};w={}",
                w.name,
                in_own_unit(w.limit, units.get(i).unwrap_or(&None)),
                w.length_us.div_ceil(1_000_000)
            )
        })
        .collect::<Vec<_>>()
        .join(", ");
    HeaderValue::from_str(&text).unwrap_or_else(|_| HeaderValue::from_static(""))
}

/// `"<window>";r=<remaining>;t=<seconds>` for the window with the least room, with
/// `;pk=:<partition>:` when the quota is kept per key (`key` is `None` for a route-wide quota).
/// Only `windows` are described: the states of a client's own windows, which follow them in
/// `outcome`, are no part of the route's policy. What remains is in the window's own unit
/// (`units`): a usage unit's millionths rounded down, so a client never reads more room than
/// there is.
pub(crate) fn item(
    windows: &[Window],
    units: &[UnitName],
    outcome: &Outcome,
    key: Option<&str>,
) -> Option<HeaderValue> {
    let states = outcome.windows.get(..windows.len())?;
    let remaining = |i: usize| in_own_unit(states[i].remaining, units.get(i).unwrap_or(&None));
    // The least remaining in its own unit, the first on a tie (as `Outcome::tightest`).
    let i = (0..states.len()).min_by_key(|&i| remaining(i))?;
    let w = &states[i];
    let left = remaining(i);
    let name = &windows[i].name;
    // Written into the buffer the header value keeps (one allocation, no `format!`): this runs
    // on every answer of a quota route. 48 bytes past the name hold the punctuation, the two
    // numbers as long as they usually are, and a partition key.
    let mut value = Vec::with_capacity(name.len() + 48);
    let mut number = itoa::Buffer::new();
    value.push(b'"');
    value.extend_from_slice(name.as_bytes());
    value.extend_from_slice(b"\";r=");
    value.extend_from_slice(number.format(left).as_bytes());
    value.extend_from_slice(b";t=");
    value.extend_from_slice(number.format(w.reset_us.div_ceil(1_000_000)).as_bytes());
    if let Some(key) = key {
        value.extend_from_slice(b";pk=:");
        value.extend_from_slice(partition_key(key).as_bytes());
        value.push(b':');
    }
    HeaderValue::from_maybe_shared(bytes::Bytes::from(value)).ok()
}

/// The `pk` Byte Sequence of a quota key: base64 of the first 12 bytes of its SHA-256. The
/// draft asks servers not to return partition keys holding sensitive information, and a quota
/// keyed on a header may be keyed on a credential; a digest still lets a client tell its
/// partitions apart.
fn partition_key(key: &str) -> String {
    use sha2::Digest;
    let digest = sha2::Sha256::digest(key.as_bytes());
    crate::config::base64(&digest[..12])
}

/// The usage unit a window counts, by name, or `None` for a window of requests. The store
/// keeps a usage unit in millionths; `/status` and the `RateLimit` headers report it whole
/// ([`in_own_unit`]).
pub type UnitName = Option<std::sync::Arc<str>>;

/// An amount the store keeps for a window (a limit, what remains), in the window's own unit:
/// requests as they are, a usage unit's millionths rounded down to whole units, so that a
/// client is never told of more room than there is.
pub(crate) fn in_own_unit(amount: u64, unit: &UnitName) -> u64 {
    match unit {
        None => amount,
        Some(_) => amount / 1_000_000,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use sluice_limiter::WindowState;

    #[test]
    fn items_parse_as_structured_field_lists() {
        let windows = [
            Window {
                name: "rpm".into(),
                limit: 60,
                length_us: 60_000_000,
            },
            Window {
                name: "burst".into(),
                limit: 5,
                length_us: 1_500,
            },
        ];
        let policy = policy(&windows, &[None, None]);
        let parsed: sfv::List = sfv::Parser::new(policy.as_bytes()).parse().unwrap();
        assert_eq!(parsed.len(), 2);
        let outcome = Outcome {
            admitted: true,
            retry_after_us: 0,
            windows: vec![
                WindowState {
                    remaining: 10,
                    reset_us: 1_000_000,
                },
                WindowState {
                    remaining: 2,
                    reset_us: 700,
                },
            ],
        };
        for key in [None, Some("tenant-a")] {
            let value = item(&windows, &[None, None], &outcome, key).unwrap();
            let parsed: sfv::List = sfv::Parser::new(value.as_bytes()).parse().unwrap();
            let sfv::ListEntry::Item(item) = &parsed[0] else {
                panic!("an item");
            };
            assert_eq!(
                item.bare_item.as_string().map(|s| s.as_str()),
                Some("burst")
            );
            let param = |name: &str| {
                item.params
                    .iter()
                    .find(|(k, _)| k.as_str() == name)
                    .map(|(_, v)| v.clone())
            };
            assert_eq!(
                param("r").and_then(|v| v.as_integer()).map(i64::from),
                Some(2)
            );
            assert_eq!(
                param("t").and_then(|v| v.as_integer()).map(i64::from),
                Some(1)
            );
            let pk = param("pk");
            assert_eq!(pk.is_some(), key.is_some(), "{value:?}");
            if let Some(pk) = pk {
                let bytes = pk.as_byte_sequence().unwrap();
                assert_eq!(bytes.len(), 12);
                assert!(!value.to_str().unwrap().contains("tenant-a"));
            }
        }
    }

    /// A client's own windows follow the route's in an outcome; the item describes the route's
    /// windows only, however full the client's are.
    #[test]
    fn a_clients_windows_are_not_the_routes_item() {
        let windows = [Window {
            name: "rpm".into(),
            limit: 60,
            length_us: 60_000_000,
        }];
        let outcome = Outcome {
            admitted: false,
            retry_after_us: 5,
            windows: vec![
                WindowState {
                    remaining: 10,
                    reset_us: 1_000_000,
                },
                WindowState {
                    remaining: 0,
                    reset_us: 9_000_000,
                },
            ],
        };
        let value = item(&windows, &[None], &outcome, None).unwrap();
        assert_eq!(value, "\"rpm\";r=10;t=1");
    }

    /// A window in a usage unit is kept in millionths and announced in its unit: the limit
    /// whole, what remains rounded down.
    #[test]
    fn a_usage_window_is_announced_in_its_unit() {
        let windows = [Window {
            name: "tpm".into(),
            limit: 1_000 * 1_000_000,
            length_us: 60_000_000,
        }];
        let units = [Some("tokens".into())];
        assert_eq!(policy(&windows, &units), "\"tpm\";q=1000;w=60");
        let outcome = Outcome {
            admitted: true,
            retry_after_us: 0,
            windows: vec![WindowState {
                remaining: 957_999_999,
                reset_us: 1_000_000,
            }],
        };
        let value = item(&windows, &units, &outcome, None).unwrap();
        assert_eq!(value, "\"tpm\";r=957;t=1");
    }
}
