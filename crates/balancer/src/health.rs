//! The health state machine of one member.
//!
//! Two sources feed it. Active probes run in the background at a fixed interval; passive
//! observations come from live traffic, where a connect failure is a strong signal that the
//! member is gone. Both count toward the same run of consecutive failures, as SPEC §3 asks,
//! but each source has its own threshold (`health_check.fall` and `passive.fall`).
//!
//! Recovery depends on the configuration: with an active check, `rise` consecutive successful
//! probes bring a member back. Without one, nothing would ever look at a down member again, so
//! after `cooldown` it gets exactly one trial request from live traffic; its outcome decides.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Thresholds that govern a member's transitions; one per pool.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HealthPolicy {
    /// Consecutive connect failures on live traffic that mark a member down.
    pub passive_fall: u32,
    /// How long a passively ejected member waits for its trial request (no active check only).
    pub cooldown: Duration,
    /// `(rise, fall)` of the active check, when one is configured.
    pub active: Option<(u32, u32)>,
}

impl Default for HealthPolicy {
    fn default() -> Self {
        HealthPolicy {
            passive_fall: 1,
            cooldown: Duration::from_secs(10),
            active: None,
        }
    }
}

/// A change of a member's health, returned to the caller so it can log it and react.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Transition {
    /// The member is now eligible for traffic.
    Up,
    /// The member is no longer eligible for traffic.
    Down,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Status {
    Up,
    /// Ejected. `trial_at` is when a trial request may go out (passive-only pools).
    Down {
        trial_at: Option<Instant>,
    },
    /// Ejected, with its single trial request in flight.
    Trial,
}

#[derive(Debug)]
struct Counters {
    status: Status,
    failures: u32,
    successes: u32,
}

/// Health of one member: a lock-free `is_up` for the hot path, and a small mutex-guarded state
/// machine that is only entered when something may change.
#[derive(Debug)]
pub struct MemberHealth {
    up: AtomicBool,
    /// Set while the counters hold anything a success must clear; lets the common success path
    /// return after one atomic load instead of taking the lock on every request.
    needs_attention: AtomicBool,
    state: Mutex<Counters>,
}

impl Default for MemberHealth {
    fn default() -> Self {
        MemberHealth::new()
    }
}

impl MemberHealth {
    /// A member starts up: traffic flows at once, and checks eject it if it is not.
    pub fn new() -> MemberHealth {
        MemberHealth {
            up: AtomicBool::new(true),
            needs_attention: AtomicBool::new(false),
            state: Mutex::new(Counters {
                status: Status::Up,
                failures: 0,
                successes: 0,
            }),
        }
    }

    /// Whether the member may receive ordinary traffic.
    #[inline]
    pub fn is_up(&self) -> bool {
        self.up.load(Ordering::Acquire)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Counters> {
        // A panic while holding this lock cannot leave the counters inconsistent in a way that
        // matters more than losing health tracking, so recover from poisoning.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn set(&self, c: &mut Counters, status: Status) -> Option<Transition> {
        let was_up = c.status == Status::Up;
        c.status = status;
        let is_up = status == Status::Up;
        self.up.store(is_up, Ordering::Release);
        self.needs_attention
            .store(!is_up || c.failures > 0, Ordering::Release);
        match (was_up, is_up) {
            (true, false) => Some(Transition::Down),
            (false, true) => Some(Transition::Up),
            _ => None,
        }
    }

    fn eject(&self, c: &mut Counters, policy: &HealthPolicy, now: Instant) -> Option<Transition> {
        c.successes = 0;
        let trial_at = match policy.active {
            Some(_) => None,
            None => Some(now + policy.cooldown),
        };
        self.set(c, Status::Down { trial_at })
    }

    /// Records the result of an active probe.
    pub fn record_probe(
        &self,
        ok: bool,
        policy: &HealthPolicy,
        now: Instant,
    ) -> Option<Transition> {
        let (rise, fall) = policy.active.unwrap_or((1, 1));
        let mut c = self.lock();
        if ok {
            c.failures = 0;
            c.successes = c.successes.saturating_add(1);
            if c.status != Status::Up && c.successes >= rise {
                return self.set(&mut c, Status::Up);
            }
            let status = c.status;
            self.set(&mut c, status);
            None
        } else {
            c.successes = 0;
            c.failures = c.failures.saturating_add(1);
            if c.status == Status::Up && c.failures >= fall {
                return self.eject(&mut c, policy, now);
            }
            self.needs_attention.store(true, Ordering::Release);
            None
        }
    }

    /// Records a connect failure (or connect timeout) seen on live traffic.
    pub fn record_connect_failure(
        &self,
        policy: &HealthPolicy,
        now: Instant,
    ) -> Option<Transition> {
        let mut c = self.lock();
        c.successes = 0;
        c.failures = c.failures.saturating_add(1);
        match c.status {
            Status::Up if c.failures >= policy.passive_fall => self.eject(&mut c, policy, now),
            // A failed trial sends the member back to wait a whole cooldown again.
            Status::Trial => {
                self.eject(&mut c, policy, now);
                None
            }
            _ => {
                self.needs_attention.store(true, Ordering::Release);
                None
            }
        }
    }

    /// Records that live traffic reached the member. Ends a trial successfully.
    pub fn record_success(&self) -> Option<Transition> {
        if !self.needs_attention.load(Ordering::Acquire) {
            return None;
        }
        let mut c = self.lock();
        c.failures = 0;
        match c.status {
            Status::Trial => self.set(&mut c, Status::Up),
            status => {
                // A down member that still answers a request picked before its ejection stays
                // down: only a trial or an active check may restore it.
                self.set(&mut c, status);
                None
            }
        }
    }

    /// Claims the member's trial request if its cooldown is over. At most one caller wins.
    pub fn try_claim_trial(&self, now: Instant) -> bool {
        let mut c = self.lock();
        match c.status {
            Status::Down { trial_at: Some(at) } if now >= at => {
                c.status = Status::Trial;
                true
            }
            _ => false,
        }
    }

    /// When this member's trial becomes due, if it waits for one.
    pub fn trial_due(&self) -> Option<Instant> {
        match self.lock().status {
            Status::Down { trial_at } => trial_at,
            _ => None,
        }
    }

    /// Gives back a claimed trial that never reached the member (the request was refused or
    /// abandoned before connecting), so that the next request can try again.
    pub fn release_trial(&self, now: Instant) {
        let mut c = self.lock();
        if c.status == Status::Trial {
            c.status = Status::Down {
                trial_at: Some(now),
            };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn passive_only(fall: u32) -> HealthPolicy {
        HealthPolicy {
            passive_fall: fall,
            cooldown: Duration::from_secs(10),
            active: None,
        }
    }

    fn with_active(rise: u32, fall: u32) -> HealthPolicy {
        HealthPolicy {
            passive_fall: 1,
            cooldown: Duration::from_secs(10),
            active: Some((rise, fall)),
        }
    }

    #[test]
    fn active_fall_needs_consecutive_failures() {
        let h = MemberHealth::new();
        let p = with_active(2, 3);
        let t = Instant::now();
        assert_eq!(h.record_probe(false, &p, t), None);
        assert_eq!(h.record_probe(false, &p, t), None);
        // A success in between resets the run.
        assert_eq!(h.record_probe(true, &p, t), None);
        assert_eq!(h.record_probe(false, &p, t), None);
        assert_eq!(h.record_probe(false, &p, t), None);
        assert!(h.is_up());
        assert_eq!(h.record_probe(false, &p, t), Some(Transition::Down));
        assert!(!h.is_up());
    }

    #[test]
    fn active_rise_needs_consecutive_successes() {
        let h = MemberHealth::new();
        let p = with_active(2, 1);
        let t = Instant::now();
        assert_eq!(h.record_probe(false, &p, t), Some(Transition::Down));
        assert_eq!(h.record_probe(true, &p, t), None);
        assert_eq!(h.record_probe(false, &p, t), None);
        assert_eq!(h.record_probe(true, &p, t), None);
        assert!(!h.is_up());
        assert_eq!(h.record_probe(true, &p, t), Some(Transition::Up));
        assert!(h.is_up());
    }

    #[test]
    fn passive_failures_eject_at_passive_fall() {
        let h = MemberHealth::new();
        let p = passive_only(2);
        let t = Instant::now();
        assert_eq!(h.record_connect_failure(&p, t), None);
        assert_eq!(h.record_success(), None);
        assert_eq!(h.record_connect_failure(&p, t), None);
        assert_eq!(h.record_connect_failure(&p, t), Some(Transition::Down));
    }

    #[test]
    fn passive_and_active_failures_share_one_run() {
        let h = MemberHealth::new();
        let p = HealthPolicy {
            passive_fall: 5,
            cooldown: Duration::from_secs(1),
            active: Some((1, 3)),
        };
        let t = Instant::now();
        h.record_connect_failure(&p, t);
        h.record_connect_failure(&p, t);
        // Two passive failures already count, so the first failed probe reaches fall = 3.
        assert_eq!(h.record_probe(false, &p, t), Some(Transition::Down));
    }

    #[test]
    fn with_active_checks_no_trial_is_offered() {
        let h = MemberHealth::new();
        let p = with_active(1, 1);
        let t = Instant::now();
        h.record_connect_failure(&p, t);
        assert!(!h.is_up());
        assert!(!h.try_claim_trial(t + Duration::from_secs(3600)));
        assert_eq!(h.record_probe(true, &p, t), Some(Transition::Up));
    }

    #[test]
    fn cooldown_then_exactly_one_trial() {
        let h = MemberHealth::new();
        let p = passive_only(1);
        let t = Instant::now();
        assert_eq!(h.record_connect_failure(&p, t), Some(Transition::Down));
        assert!(!h.try_claim_trial(t + Duration::from_secs(9)), "too early");
        assert!(h.try_claim_trial(t + Duration::from_secs(10)));
        assert!(
            !h.try_claim_trial(t + Duration::from_secs(11)),
            "only one trial at a time"
        );
        assert!(!h.is_up(), "the trial alone does not restore the member");
        assert_eq!(h.record_success(), Some(Transition::Up));
        assert!(h.is_up());
    }

    #[test]
    fn failed_trial_waits_a_whole_cooldown_again() {
        let h = MemberHealth::new();
        let p = passive_only(1);
        let t = Instant::now();
        h.record_connect_failure(&p, t);
        let t2 = t + Duration::from_secs(10);
        assert!(h.try_claim_trial(t2));
        assert_eq!(h.record_connect_failure(&p, t2), None);
        assert!(!h.try_claim_trial(t2 + Duration::from_secs(9)));
        assert_eq!(h.trial_due(), Some(t2 + Duration::from_secs(10)));
        assert!(h.try_claim_trial(t2 + Duration::from_secs(10)));
    }

    #[test]
    fn released_trial_can_be_claimed_again() {
        let h = MemberHealth::new();
        let p = passive_only(1);
        let t = Instant::now();
        h.record_connect_failure(&p, t);
        let t2 = t + Duration::from_secs(10);
        assert!(h.try_claim_trial(t2));
        h.release_trial(t2);
        assert!(h.try_claim_trial(t2));
    }

    #[test]
    fn success_on_a_down_member_does_not_restore_it() {
        let h = MemberHealth::new();
        let p = passive_only(1);
        h.record_connect_failure(&p, Instant::now());
        assert_eq!(h.record_success(), None);
        assert!(!h.is_up());
    }
}
