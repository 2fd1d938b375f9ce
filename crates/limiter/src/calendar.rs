//! Calendar windows: the period (a day, an ISO week, a month) that holds an instant, in a time
//! zone, as instants in Unix microseconds that a store can compare with its clock.
//!
//! Providers' budgets reset at a boundary in their own zone, and a day there is not always 24
//! hours: a change to or from summer time makes one 23 or 25 hours long, and in some zones the
//! clock skips midnight itself, so that the day starts at 01:00. Periods are therefore cut by
//! civil-time arithmetic on the tz database ([`jiff`], with its database built in, so that
//! every instance on every machine cuts at the same instants), never by adding 86,400 seconds.
//!
//! The clock is passed in ([`WallClock`]) so that tests can stand on either side of a boundary
//! without waiting for it.

use jiff::civil::Date;
use jiff::tz::TimeZone;
use jiff::{Timestamp, ToSpan};

/// The length of a calendar window's period.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Period {
    /// Midnight to midnight.
    Day,
    /// Monday midnight to the next Monday midnight (ISO weeks).
    Week,
    /// Midnight on the first of a month to midnight on the first of the next.
    Month,
}

/// One period of a calendar window: `[start_us, end_us)` in Unix microseconds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Bounds {
    /// The first microsecond of the period.
    pub start_us: u64,
    /// The first microsecond of the next period.
    pub end_us: u64,
}

impl Bounds {
    /// Microseconds from `now_us` to the next period, the `Retry-After` of a full calendar
    /// window; 0 once `now_us` is past the end.
    pub fn until_end_us(&self, now_us: u64) -> u64 {
        self.end_us.saturating_sub(now_us)
    }
}

/// The time now, as Unix microseconds: the system's, or a test's.
pub trait WallClock {
    /// Microseconds since the Unix epoch.
    fn now_unix_us(&self) -> u64;
}

/// The system's wall clock.
#[derive(Debug, Clone, Copy, Default)]
pub struct SystemClock;

impl WallClock for SystemClock {
    fn now_unix_us(&self) -> u64 {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| u64::try_from(d.as_micros()).unwrap_or(u64::MAX))
    }
}

/// A calendar window's period in a time zone.
#[derive(Debug, Clone, PartialEq)]
pub struct Calendar {
    period: Period,
    zone: TimeZone,
}

impl Calendar {
    /// Periods of `period` with boundaries at midnight in `zone`.
    pub fn new(period: Period, zone: TimeZone) -> Calendar {
        Calendar { period, zone }
    }

    /// The period.
    pub fn period(&self) -> Period {
        self.period
    }

    /// The period that holds `clock`'s now.
    pub fn current(&self, clock: &dyn WallClock) -> Option<Bounds> {
        self.bounds_at(clock.now_unix_us())
    }

    /// The period that holds the instant `unix_us`. `None` only past what the tz arithmetic
    /// reaches (the year 9999), where no clock will be.
    pub fn bounds_at(&self, unix_us: u64) -> Option<Bounds> {
        let now = Timestamp::from_microsecond(i64::try_from(unix_us).ok()?).ok()?;
        let today = now.to_zoned(self.zone.clone()).date();
        let first = match self.period {
            Period::Day => today,
            Period::Week => {
                let back = today.weekday().to_monday_zero_offset();
                today.checked_sub(i64::from(back).days()).ok()?
            }
            Period::Month => today.first_of_month(),
        };
        let next = match self.period {
            Period::Day => first.tomorrow().ok()?,
            Period::Week => first.checked_add(7.days()).ok()?,
            Period::Month => first.checked_add(1.month()).ok()?,
        };
        Some(Bounds {
            start_us: self.midnight_us(first)?,
            end_us: self.midnight_us(next)?,
        })
    }

    /// The first instant of `date` in the zone: midnight, or the first time the clock shows
    /// that day when a change of offset skips midnight.
    fn midnight_us(&self, date: Date) -> Option<u64> {
        let start = date.to_zoned(self.zone.clone()).ok()?.start_of_day().ok()?;
        u64::try_from(start.timestamp().as_microsecond()).ok()
    }
}

#[cfg(test)]
mod tests {
    use std::cell::Cell;

    use super::*;

    /// A clock a test sets by hand.
    struct Hand(Cell<u64>);

    impl WallClock for Hand {
        fn now_unix_us(&self) -> u64 {
            self.0.get()
        }
    }

    fn us(rfc3339: &str) -> u64 {
        let ts: Timestamp = rfc3339.parse().unwrap();
        u64::try_from(ts.as_microsecond()).unwrap()
    }

    fn zone(name: &str) -> TimeZone {
        jiff::tz::db().get(name).unwrap()
    }

    const HOUR: u64 = 3_600_000_000;

    #[test]
    fn a_day_that_loses_an_hour_to_summer_time_is_23_hours() {
        let paris = Calendar::new(Period::Day, zone("Europe/Paris"));
        let clock = Hand(Cell::new(us("2025-03-30T12:00:00Z")));
        let day = paris.current(&clock).unwrap();
        // Midnight CET (UTC+1) to midnight CEST (UTC+2).
        assert_eq!(day.start_us, us("2025-03-29T23:00:00Z"));
        assert_eq!(day.end_us, us("2025-03-30T22:00:00Z"));
        assert_eq!(day.end_us - day.start_us, 23 * HOUR);
        assert_eq!(day.until_end_us(clock.now_unix_us()), 10 * HOUR);

        // The last microsecond of the day is in it; the next one starts the next day.
        clock.0.set(day.end_us - 1);
        assert_eq!(paris.current(&clock), Some(day));
        clock.0.set(day.end_us);
        let next = paris.current(&clock).unwrap();
        assert_eq!(next.start_us, day.end_us);
        assert_eq!(next.end_us - next.start_us, 24 * HOUR);
        // Before the change, the instant of the hour that does not exist (02:30 local).
        assert_eq!(paris.bounds_at(us("2025-03-30T01:30:00Z")), Some(day));
    }

    #[test]
    fn a_day_that_gains_an_hour_back_is_25_hours() {
        let paris = Calendar::new(Period::Day, zone("Europe/Paris"));
        let day = paris.bounds_at(us("2025-10-26T01:30:00Z")).unwrap();
        assert_eq!(day.start_us, us("2025-10-25T22:00:00Z"));
        assert_eq!(day.end_us, us("2025-10-26T23:00:00Z"));
        assert_eq!(day.end_us - day.start_us, 25 * HOUR);
        // Both 02:30s of that night (CEST, then CET) are the same day.
        assert_eq!(paris.bounds_at(us("2025-10-26T00:30:00Z")), Some(day));
        assert_eq!(paris.bounds_at(us("2025-10-26T01:30:00Z")), Some(day));
    }

    #[test]
    fn a_day_whose_midnight_is_skipped_starts_when_the_clock_shows_it() {
        // Chile moved its clocks from 00:00 to 01:00 on 2024-09-08: that day began at 01:00
        // local, UTC-3.
        let santiago = Calendar::new(Period::Day, zone("America/Santiago"));
        let day = santiago.bounds_at(us("2024-09-08T15:00:00Z")).unwrap();
        assert_eq!(day.start_us, us("2024-09-08T04:00:00Z"));
        assert_eq!(day.end_us, us("2024-09-09T03:00:00Z"));
        let before = santiago.bounds_at(day.start_us - 1).unwrap();
        assert_eq!(before.end_us, day.start_us, "periods meet, with no gap");
    }

    #[test]
    fn weeks_are_iso_weeks_and_months_calendar_months() {
        let paris = zone("Europe/Paris");
        let sunday = us("2025-03-30T12:00:00Z");
        let week = Calendar::new(Period::Week, paris.clone())
            .bounds_at(sunday)
            .unwrap();
        // Monday 24 March, midnight CET, to Monday 31 March, midnight CEST.
        assert_eq!(week.start_us, us("2025-03-23T23:00:00Z"));
        assert_eq!(week.end_us, us("2025-03-30T22:00:00Z"));
        assert_eq!(week.end_us - week.start_us, (7 * 24 - 1) * HOUR);
        let month = Calendar::new(Period::Month, paris)
            .bounds_at(sunday)
            .unwrap();
        assert_eq!(month.start_us, us("2025-02-28T23:00:00Z"));
        assert_eq!(month.end_us, us("2025-03-31T22:00:00Z"));

        // UTC, a leap February.
        let utc = Calendar::new(Period::Month, TimeZone::UTC);
        let feb = utc.bounds_at(us("2024-02-29T23:59:59.999999Z")).unwrap();
        assert_eq!(feb.start_us, us("2024-02-01T00:00:00Z"));
        assert_eq!(feb.end_us, us("2024-03-01T00:00:00Z"));
        let monday = Calendar::new(Period::Week, TimeZone::UTC)
            .bounds_at(us("2024-03-04T00:00:00Z"))
            .unwrap();
        assert_eq!(
            monday.start_us,
            us("2024-03-04T00:00:00Z"),
            "a Monday opens its week"
        );
    }

    #[test]
    fn a_clock_stepped_across_the_boundary_sees_the_next_period() {
        let utc = Calendar::new(Period::Day, TimeZone::UTC);
        let clock = Hand(Cell::new(us("2026-12-31T23:59:59.999999Z")));
        let last = utc.current(&clock).unwrap();
        assert_eq!(last.until_end_us(clock.now_unix_us()), 1);
        clock.0.set(clock.now_unix_us() + 1);
        let first = utc.current(&clock).unwrap();
        assert_eq!(first.start_us, us("2027-01-01T00:00:00Z"));
        assert_eq!(last.until_end_us(clock.now_unix_us()), 0);
        // Instants no tz arithmetic reaches have no period.
        assert_eq!(utc.bounds_at(u64::MAX), None);
        assert!(SystemClock.now_unix_us() > us("2024-01-01T00:00:00Z"));
    }
}
