//! The throttle's counting, its /64 grouping, and its bound under a spray of sources.

use std::collections::HashMap;
use std::net::{IpAddr, Ipv4Addr};
use std::time::{Duration, Instant};

use proptest::prelude::*;

use super::{Failure, Settings, Source, Throttle};

const WINDOW: Duration = Duration::from_secs(60);
const COOLDOWN: Duration = Duration::from_secs(300);

fn settings(limit: u32, max_sources: usize) -> Settings {
    Settings {
        limit,
        window: WINDOW,
        cooldown: COOLDOWN,
        max_sources,
    }
}

fn ip(s: &str) -> IpAddr {
    s.parse().unwrap()
}

fn v4(n: u32) -> IpAddr {
    IpAddr::V4(Ipv4Addr::from(0x0a00_0000 + n))
}

fn secs(s: u64) -> Duration {
    Duration::from_secs(s)
}

#[test]
fn a_source_is_throttled_at_the_limit_and_not_before() {
    let s = settings(3, 16);
    let t = Throttle::new();
    let now = Instant::now();
    let a = ip("192.0.2.1");
    assert_eq!(t.fail_at(a, &s, now), None);
    assert_eq!(t.fail_at(a, &s, now), None);
    assert_eq!(
        t.check_at(a, &s, now),
        None,
        "two failures of three may still try"
    );
    assert_eq!(t.fail_at(a, &s, now), Some(COOLDOWN));
    assert_eq!(t.check_at(a, &s, now + secs(1)), Some(COOLDOWN - secs(1)));
    assert_eq!(
        t.check_at(ip("192.0.2.2"), &s, now),
        None,
        "another address still tries"
    );
}

#[test]
fn failures_count_within_the_window_only() {
    let s = settings(3, 16);
    let t = Throttle::new();
    let now = Instant::now();
    let a = ip("192.0.2.1");
    t.fail_at(a, &s, now);
    t.fail_at(a, &s, now + secs(1));
    // The window started at the first failure: a third one after it starts a new count.
    assert_eq!(t.fail_at(a, &s, now + WINDOW), None);
    assert_eq!(t.fail_at(a, &s, now + WINDOW + secs(1)), None);
    assert_eq!(t.check_at(a, &s, now + WINDOW + secs(1)), None);
    assert_eq!(t.fail_at(a, &s, now + WINDOW + secs(2)), Some(COOLDOWN));
}

#[test]
fn the_cooldown_ends_and_counting_starts_over() {
    let s = settings(2, 16);
    let t = Throttle::new();
    let now = Instant::now();
    let a = ip("192.0.2.1");
    t.fail_at(a, &s, now);
    assert!(t.fail_at(a, &s, now).is_some());
    assert!(t.check_at(a, &s, now + COOLDOWN - secs(1)).is_some());
    let later = now + COOLDOWN;
    assert_eq!(t.check_at(a, &s, later), None);
    assert_eq!(
        t.fail_at(a, &s, later),
        None,
        "one failure of two after the cooldown"
    );
    assert!(t.fail_at(a, &s, later).is_some());
}

#[test]
fn ipv6_counts_per_64_and_mapped_ipv4_as_ipv4() {
    let s = settings(3, 16);
    let t = Throttle::new();
    let now = Instant::now();
    for host in ["2001:db8::1", "2001:db8::2", "2001:db8::ffff:1"] {
        t.fail_at(ip(host), &s, now);
    }
    assert!(
        t.check_at(ip("2001:db8::abcd"), &s, now).is_some(),
        "same /64"
    );
    assert!(t
        .check_at(ip("2001:db8:0:0:1234:5678:9abc:def0"), &s, now)
        .is_some());
    assert_eq!(t.check_at(ip("2001:db8:0:1::1"), &s, now), None, "next /64");
    assert_eq!(
        Source::of(ip("::ffff:192.0.2.7")),
        Source::of(ip("192.0.2.7"))
    );
    assert_ne!(Source::of(ip("192.0.2.7")), Source::of(ip("192.0.2.8")));
}

#[test]
fn at_the_bound_the_oldest_source_not_throttled_gives_way() {
    let s = settings(2, 2);
    let t = Throttle::new();
    let now = Instant::now();
    let (a, b, c) = (v4(1), v4(2), v4(3));
    t.fail_at(b, &s, now);
    t.fail_at(b, &s, now);
    t.fail_at(a, &s, now + secs(1));
    // Full: b throttled, a counting. c takes a's place, not b's.
    t.fail_at(c, &s, now + secs(2));
    assert_eq!(t.sources(), 2);
    assert!(t.check_at(b, &s, now + secs(2)).is_some());
    assert!(
        t.fail_at(c, &s, now + secs(2)).is_some(),
        "c counts in its own entry"
    );
}

#[test]
fn a_table_full_of_throttled_sources_throttles_newcomers_together() {
    let s = settings(2, 2);
    let t = Throttle::new();
    let now = Instant::now();
    for a in [v4(1), v4(2)] {
        t.fail_at(a, &s, now);
        t.fail_at(a, &s, now);
    }
    // New sources: no room, so they count in the overflow bucket, and none pushes out a
    // throttled one.
    assert_eq!(t.fail_at(v4(3), &s, now), None);
    assert!(t.fail_at(v4(4), &s, now).is_some());
    assert_eq!(t.sources(), 2);
    assert!(t.check_at(v4(1), &s, now).is_some());
    assert!(t.check_at(v4(2), &s, now).is_some());
    assert!(
        t.check_at(v4(5), &s, now).is_some(),
        "a newcomer shares the bucket"
    );
    // When a cooldown ends there is room again, and a newcomer has its own entry.
    let later = now + COOLDOWN;
    assert_eq!(t.check_at(v4(5), &s, later), None);
    assert_eq!(t.fail_at(v4(5), &s, later), None);
}

#[test]
fn a_lower_bound_after_a_reload_gives_up_sources_not_throttled() {
    let s = settings(2, 8);
    let t = Throttle::new();
    let now = Instant::now();
    let a = v4(1);
    t.fail_at(a, &s, now);
    t.fail_at(a, &s, now);
    for n in 2..6 {
        t.fail_at(v4(n), &s, now);
    }
    assert_eq!(t.sources(), 5);
    // The reloaded bound holds from the next new source on, and the throttled one stays.
    let lower = settings(5, 2);
    t.fail_at(v4(9), &lower, now);
    assert_eq!(t.sources(), 2);
    assert!(t.check_at(a, &lower, now).is_some());
}

#[test]
fn reasons_are_the_label_values() {
    let names: Vec<_> = Failure::ALL.iter().map(|f| f.as_str()).collect();
    assert_eq!(
        names,
        [
            "bad_token",
            "bad_basic",
            "unknown_cert",
            "wrong_address",
            "malformed"
        ]
    );
}

#[derive(Debug, Clone)]
enum Op {
    Fail(u32),
    Check(u32),
    Wait(u64),
}

fn op() -> impl Strategy<Value = Op> {
    // Sources from a pool larger than the table, and waits around the window and cooldown.
    prop_oneof![
        6 => (0u32..40).prop_map(Op::Fail),
        3 => (0u32..40).prop_map(Op::Check),
        1 => (0u64..400).prop_map(Op::Wait),
    ]
}

proptest! {
    /// Whatever sources fail and however time goes, the table holds at most `max_sources`,
    /// its queues stay within a constant of that, and a source told it is throttled stays
    /// throttled for its whole cooldown: no pressure on the table frees it.
    #[test]
    fn the_table_stays_bounded_and_never_frees_a_throttled_source(
        limit in 1u32..4,
        max_sources in 1usize..8,
        ops in prop::collection::vec(op(), 1..400),
    ) {
        let s = settings(limit, max_sources);
    let t = Throttle::new();
        let start = Instant::now();
        let mut now = start;
        let mut until: HashMap<Source, Instant> = HashMap::new();
        for op in ops {
            match op {
                Op::Fail(n) => {
                    let refused = t.fail_at(v4(n), &s, now);
                    // A newcomer counted in the overflow bucket has no entry of its own to
                    // keep: it is refused only while the table has no room.
                    let own = t.lock().entries.contains_key(&Source::of(v4(n)));
                    if let (Some(left), true) = (refused, own) {
                        let end = until.entry(Source::of(v4(n))).or_insert(now);
                        *end = (*end).max(now + left);
                    }
                }
                Op::Check(n) => {
                    let refused = t.check_at(v4(n), &s, now);
                    if let Some(end) = until.get(&Source::of(v4(n))) {
                        if now < *end {
                            prop_assert!(refused.is_some(), "source {n} freed before its cooldown ended");
                        }
                    }
                }
                Op::Wait(s) => now += secs(s),
            }
            prop_assert!(t.sources() <= max_sources);
            let queued = {
                let table = t.lock();
                table.counting.len() + table.throttled.len()
            };
            prop_assert!(queued <= 2 * max_sources + 64 + 2);
        }
    }
}
