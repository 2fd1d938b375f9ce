//! The live side of a route's recent history: what a request adds to it as it ends. Apart from
//! the sampler ([`super`]) so that a route can hold its counters without depending on the table.

use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

/// The status classes counted, in the order of a sample's counts.
pub const CLASSES: [&str; 6] = ["2xx", "3xx", "4xx", "429", "5xx", "other"];

/// Sub-buckets per power of two of microseconds: 4 keeps a bucket within 25 % of its value,
/// close enough for a chart of p50 and p99.
const SUB_BITS: u32 = 2;
const SUB: usize = 1 << SUB_BITS;

/// The largest power of two of microseconds told apart (2^27 µs, about 134 s); anything longer
/// counts in the last bucket.
const MAX_EXPONENT: u32 = 27;

/// Latency buckets: the values below [`SUB`] exactly, then [`SUB`] per power of two.
pub const BUCKETS: usize = (MAX_EXPONENT as usize) * SUB;

/// The column of what has no latency worth charting (a tunnel lives for minutes).
const NO_LATENCY: usize = BUCKETS;

/// Columns per class: each latency bucket, then [`NO_LATENCY`].
pub const COLUMNS: usize = BUCKETS + 1;

/// A route's counters since it was first built: one per status class and latency bucket,
/// carried over by reloads. A request's end is one relaxed atomic increment, no lock; the
/// sampler reads the counters once a second and keeps the differences. The counters wrap; a
/// difference taken with wrapping arithmetic stays right while fewer than 2^32 requests end
/// in one second.
pub struct Live {
    counts: Box<[AtomicU32]>,
}

impl std::fmt::Debug for Live {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Live")
    }
}

impl Default for Live {
    fn default() -> Self {
        Live::new()
    }
}

impl Live {
    /// Counters at 0.
    pub fn new() -> Live {
        Live {
            counts: (0..CLASSES.len() * COLUMNS)
                .map(|_| AtomicU32::new(0))
                .collect(),
        }
    }

    /// Counts one request answered with `status` (0: none was sent) after `latency`; `None`
    /// for a tunnel, which counts in its class but not in the latencies.
    pub fn record(&self, status: u16, latency: Option<Duration>) {
        let column = latency.map_or(NO_LATENCY, bucket_of);
        self.counts[class_of(status) * COLUMNS + column].fetch_add(1, Ordering::Relaxed);
    }

    /// The counters' values, into `out` (one per class and column).
    pub fn read(&self, out: &mut [u32]) {
        for (o, c) in out.iter_mut().zip(self.counts.iter()) {
            *o = c.load(Ordering::Relaxed);
        }
    }
}

/// The index in [`CLASSES`] of a status.
fn class_of(status: u16) -> usize {
    match status {
        429 => 3,
        200..=299 => 0,
        300..=399 => 1,
        400..=499 => 2,
        500..=599 => 4,
        _ => 5,
    }
}

/// The latency bucket of `d`: microseconds below [`SUB`] as they are, then [`SUB`] buckets
/// per power of two, the last one open-ended.
pub fn bucket_of(d: Duration) -> usize {
    let us = u64::try_from(d.as_micros()).unwrap_or(u64::MAX);
    if us < SUB as u64 {
        return us as usize;
    }
    let exponent = 63 - us.leading_zeros();
    if exponent > MAX_EXPONENT {
        return BUCKETS - 1;
    }
    let sub = ((us >> (exponent - SUB_BITS)) as usize) & (SUB - 1);
    ((exponent - SUB_BITS + 1) as usize) * SUB + sub
}

/// The middle of bucket `i`, in microseconds: what a quantile falling in it reads as.
pub fn bucket_middle_us(i: usize) -> f64 {
    if i < SUB {
        return i as f64;
    }
    let exponent = (i / SUB) as u32 + SUB_BITS - 1;
    let step = 1u64 << (exponent - SUB_BITS);
    let low = (SUB as u64 + (i % SUB) as u64) * step;
    low as f64 + step as f64 / 2.0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_cover_every_latency_in_order() {
        let mut last = 0;
        for us in (0..100_000u64).chain([1 << 27, (1 << 28) - 1, 1 << 28, u64::MAX / 2]) {
            let b = bucket_of(Duration::from_micros(us));
            assert!(b < BUCKETS, "{us} µs -> {b}");
            assert!(
                b >= last,
                "buckets grow with latency: {us} µs -> {b} < {last}"
            );
            last = b;
            // A bucket's middle is within a quarter of the latency counted in it (below the
            // last, open-ended one).
            if us > 0 && us < 1 << 28 {
                let middle = bucket_middle_us(b);
                assert!(
                    (middle - us as f64).abs() <= us as f64 / 4.0 + 0.5,
                    "{us} µs -> {b} reads {middle}"
                );
            }
        }
        assert_eq!(bucket_of(Duration::from_secs(3600)), BUCKETS - 1);
    }

    #[test]
    fn a_request_counts_in_its_class_and_bucket() {
        let live = Live::new();
        live.record(200, Some(Duration::from_millis(3)));
        live.record(429, Some(Duration::from_micros(1)));
        live.record(503, None);
        live.record(0, None);
        let mut read = vec![0; CLASSES.len() * COLUMNS];
        live.read(&mut read);
        assert_eq!(read[bucket_of(Duration::from_millis(3))], 1);
        assert_eq!(read[3 * COLUMNS + 1], 1);
        assert_eq!(read[4 * COLUMNS + NO_LATENCY], 1);
        assert_eq!(read[5 * COLUMNS + NO_LATENCY], 1);
        assert_eq!(read.iter().sum::<u32>(), 4);
    }
}
