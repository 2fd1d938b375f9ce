//! The syntax of the `RateLimit-Policy` and `RateLimit` headers of
//! draft-ietf-httpapi-ratelimit-headers, in one place: the route's policy is written once when
//! the table is built, a request's item once per answer.

use http::HeaderValue;
use sluice_state::{Outcome, Window};

/// `"<name>";q=<limit>;w=<seconds>, …` for every window. Structured-field integers have no
/// fractions, so a window shorter than a second is announced as 1 s.
pub(crate) fn policy(windows: &[Window]) -> HeaderValue {
    let text = windows
        .iter()
        .map(|w| {
            format!(
                "\"{}\";q={};w={}",
                w.name,
                w.limit,
                w.length_us.div_ceil(1_000_000)
            )
        })
        .collect::<Vec<_>>()
        .join(", ");
    HeaderValue::from_str(&text).unwrap_or_else(|_| HeaderValue::from_static(""))
}

/// `"<window>";r=<remaining>;t=<seconds>` for the window with the least room.
pub(crate) fn item(windows: &[Window], outcome: &Outcome) -> Option<HeaderValue> {
    let i = outcome.tightest()?;
    let w = outcome.windows.get(i)?;
    let value = format!(
        "\"{}\";r={};t={}",
        windows.get(i)?.name,
        w.remaining,
        w.reset_us.div_ceil(1_000_000)
    );
    HeaderValue::from_str(&value).ok()
}
